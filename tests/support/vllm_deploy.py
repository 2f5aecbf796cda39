"""Test helpers for real vLLM destinations: tiny vLLM-compatible models, the reference checkpoint
of the demo's canonical weights, replica actors, and the WeightSync that connects them.

Runs only under the engine environment (tools/vllm_env.sh); imported by tests/engines only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.demo.weights import bits_to_torch, reference_weights
from sync_runtime.schema.crd import DeploymentRef, Parallelism, Transport, WeightSyncSpec

ROOT = Path(__file__).resolve().parents[2]
_COMMON = {
    "vocab_size": 1000,  # not a multiple of 64: the padded rows (Vp = 1024) are exercised
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # Tied embeddings: vLLM's lm_head is embed_tokens.weight (the tied re-process of the apply).
    "qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_key_value_heads": 1,  # TP=2 replicates the single KV head
        "head_dim": 64,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 128,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,  # vLLM's CPU MLA kernel needs kv_lora_rank + qk_rope_head_dim == 576
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
}
PROMPTS = [[(7 * i + 13 * j) % 997 + 3 for j in range(8 + i)] for i in range(4)]
"""Four prompts of 8-11 token ids."""
MAX_TOKENS = 16


def write_model(directory: Path, config: dict[str, Any], manifest: Manifest, seed: int, version: str) -> str:
    """An HF model dir: config.json + model.safetensors holding the demo's canonical tensors of
    (seed, version), the same bits the demo's source actors hold shards of."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    weights = {n: bits_to_torch(a) for n, a in reference_weights(manifest, seed, version).items()}
    save_file({n: t.contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"))
    return str(directory)


def engine_env(tp: int) -> dict[str, str]:
    return {
        "PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}",  # the spawned vLLM workers import sync_runtime
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default would take most of the RAM
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0-1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def start_replica(
    name: str,
    namespace: str,
    model_dir: str,
    *,
    tp: int,
    ep: bool = False,
    replica: int = 0,
    load_format: str = "dummy",
    extension: str | None = None,
) -> Any:
    from sync_runtime.engines.vllm_replica import WORKER_EXTENSION, VllmReplica, replica_options

    options = replica_options(name, namespace, tp, engine_env(tp))
    return (
        ray.remote(VllmReplica)
        .options(**options)
        .remote(
            model_dir,
            replica=replica,
            tensor_parallel_size=tp,
            enable_expert_parallel=ep,
            load_format=load_format,
            worker_extension_cls=extension or WORKER_EXTENSION,
        )
    )


def destination_ref(name: str, namespace: str, prefix: str, spec: ParallelSpec) -> DeploymentRef:
    return DeploymentRef(
        name=name,
        ray_address="-",
        ray_namespace=namespace,
        actor_prefix=prefix,
        layout="vllm",
        parallelism=Parallelism.from_spec(spec),
    )


def sync_spec(
    model_path: str,
    namespace: str,
    src: ParallelSpec,
    destinations: Sequence[DeploymentRef],
    version: str,
    **transport: Any,
) -> WeightSyncSpec:
    source = DeploymentRef(
        name="trainer",
        ray_address="-",
        ray_namespace=namespace,
        actor_prefix="trainer-",
        layout="megatron",
        parallelism=Parallelism.from_spec(src),
    )
    return WeightSyncSpec(
        source=source,
        destinations=list(destinations),
        version=version,
        model=model_path,
        transport=Transport(transfer_timeout_seconds=60, **transport),
    )


def generations(handles: Sequence[Any]) -> list[list[dict[str, list]]]:
    """Every replica's greedy generation of PROMPTS (concurrently)."""
    return ray.get([h.generate.remote(PROMPTS, MAX_TOKENS) for h in handles], timeout=300)


def rows_equal(a: list[dict[str, list]], b: list[dict[str, list]]) -> int:
    """How many prompt rows agree exactly (token ids and every logprob bit)."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def stop_replicas(handles: Sequence[Any]) -> None:
    """Stop each engine's processes, then the actor (idempotent; a dead engine is skipped)."""
    for h in handles:
        with contextlib.suppress(Exception):  # already stopped, or its engine died (fault tests)
            ray.get(h.shutdown.remote(), timeout=60)
        ray.kill(h)
