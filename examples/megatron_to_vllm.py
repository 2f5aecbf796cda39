"""A real Megatron-Core trainer synced into a real vLLM engine, on the public API only.

What a user has already: `Trainer`, Ray actors that each own one rank of a Megatron-Core model,
and `Rollout`, a Ray actor holding an offline `vllm.LLM`. What WeightSync adds (marked
`# WeightSync` below): the trainer mixes in `MegatronSourceParticipant`, calls
`ws_megatron_init` once its model is built and registers itself with the deployment
(`register`); the engine is started with the `weightsync` weight-transfer backend and
registered from the driver (`register_vllm_actor`). No actor is renamed: discovery finds
them by the registration. Then `InProcessSync(spec).push(version)` syncs.

The check: a second engine loads the trainer's weights from a checkpoint (the trainer's shards
gathered and written as a Hugging Face model); greedy generation of the synced engine must equal
it, token ids and every logprob bit, and must differ before the sync (the engine starts with
dummy weights). Exits 0 when both hold, 1 otherwise.

Tiny Qwen3-style model (2 layers, hidden 256) built from a config with Megatron's seeded
initialisation; trainer tp=2 (two actors, gloo), engine tp=1, all on CPU. Run in the engine
environment (vLLM + Megatron-Core):

    VE=$(bash tools/vllm_env.sh); $VE/bin/python examples/megatron_to_vllm.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from sync_runtime.engines import megatron_cpu
from sync_runtime.engines.megatron import MegatronSourceParticipant  # WeightSync
from sync_runtime.engines.megatron_convert import export_shards, gather_full, to_hf
from sync_runtime.engines.registration import register_vllm_actor  # WeightSync
from sync_runtime.runtime.registry import register  # WeightSync
from sync_runtime.schema.crd import DeploymentRef, Parallelism, WeightSyncSpec
from sync_runtime.trainer import InProcessSync  # WeightSync

NAMESPACE = "megatron-to-vllm"
HF_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS = [[(7 * i + 13 * j) % 997 + 3 for j in range(8 + i)] for i in range(4)]
MAX_TOKENS = 16


class Trainer(MegatronSourceParticipant):  # WeightSync: the mixin
    """One trainer rank: joins the trainer's gloo world, builds its Megatron-Core shard."""

    def __init__(self, rank: int, world_size: int, master: str) -> None:
        torch.set_num_threads(1)
        megatron_cpu.install()  # CPU only: keeps Megatron's CUDA-only calls off the CPU
        host, port = master.rsplit(":", 1)
        store = torch.distributed.TCPStore(host, int(port), is_master=False)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

    def setup(self, hf_config: dict[str, Any], tp: int, seed: int) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # A dense model: no expert parallelism (Megatron's default would split experts over TP).
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
        torch.manual_seed(seed)
        self.model = [build_gpt(hf_config, tp)]
        self.ws_megatron_init(self.model, hf_config, version="step-0")  # WeightSync
        register("trainer", namespace=NAMESPACE)  # WeightSync: this actor is a "trainer" rank

    def shards(self) -> list[Any]:
        """This rank's tensors with their split attributes (for the checkpoint)."""
        assert self.ws_source is not None
        return export_shards(self.ws_source.live)


def build_gpt(hf_config: dict[str, Any], tp: int) -> torch.nn.Module:
    """A Megatron-Core GPTModel (local spec) of the config, bf16, seeded init."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = hf_config
    config = TransformerConfig(
        **megatron_cpu.CPU_CONFIG,
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"],
        kv_channels=c["head_dim"],
        ffn_hidden_size=c["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=c["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        init_method_std=0.2,  # large: a flat attention would make every engine look alike
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        attention_softmax_in_fp32=True,
    )
    vocab = -(-c["vocab_size"] // (128 * tp)) * 128 * tp  # Megatron pads to a multiple of 128*tp
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=64,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=int(c["rope_theta"]),
    )


class Rollout:
    """The user's engine actor: an offline vLLM engine; nothing from WeightSync but the backend."""

    def __init__(self, model_dir: str, load_format: str) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=model_dir,
            load_format=load_format,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enable_prefix_caching=False,
            max_model_len=128,
            max_num_seqs=4,
            kv_cache_memory_bytes=64 << 20,  # per worker; vLLM's CPU default takes a large share of the RAM
            enforce_eager=True,
            seed=0,
            weight_transfer_config={"backend": "weightsync"},  # WeightSync
        )

    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        """Greedy continuations: token ids and the chosen tokens' logprobs."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
        out = []
        for p in prompts:  # one at a time: batching would change the kernels' reductions
            (o,) = self.llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            ids = list(o.outputs[0].token_ids)
            out.append((ids, [d[t].logprob for t, d in zip(ids, o.outputs[0].logprobs or [], strict=True)]))
        return out

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def engine_env() -> dict[str, str]:
    """CPU vLLM: this package on the path of any process the engine starts, and
    the engine core in the actor's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as RL
    frameworks run `vllm.LLM`); with one worker vLLM runs it there too (its "uni" executor), so the
    whole engine is this one process: none to start, none to outlive the actor."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def start_trainers(tp: int, seed: int, store: torch.distributed.TCPStore) -> list[Any]:
    master = f"127.0.0.1:{store.port}"
    actor = ray.remote(Trainer).options(num_cpus=0)
    trainers = [actor.remote(rank, tp, master) for rank in range(tp)]
    ray.get([t.setup.remote(HF_CONFIG, tp, seed) for t in trainers])  # collective: all at once
    return trainers


def write_checkpoint(trainers: list[Any], directory: Path) -> str:
    """The trainer's weights as a Hugging Face model directory (what the oracle engine loads)."""
    from safetensors.torch import save_file

    full = gather_full(ray.get([t.shards.remote() for t in trainers]))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(
        {n: t.contiguous() for n, t in to_hf(full, HF_CONFIG).items()}, str(directory / "model.safetensors")
    )
    return str(directory)


def run_engine(model_dir: str, load_format: str) -> Any:
    actor = ray.remote(Rollout).options(num_cpus=0, runtime_env={"env_vars": engine_env()})
    return actor.remote(model_dir, load_format)


def spec_for(address: str, tp: int) -> WeightSyncSpec:
    """The WeightSync: deployments named as registered; the prefixes match no actor here."""

    def ref(name: str, layout: str, parallelism: Parallelism) -> DeploymentRef:
        return DeploymentRef(
            name=name,
            ray_address=address,
            ray_namespace=NAMESPACE,
            actor_prefix=f"{name}-",
            layout=layout,
            parallelism=parallelism,
        )

    return WeightSyncSpec(
        source=ref("trainer", "megatron", Parallelism(tp=tp)),
        destinations=[ref("rollout", "vllm", Parallelism(tp=1))],
        version="step-0",
        allow_unauthenticated_ray=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 2 KV heads: a TP size of 1 or 2 splits them
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2), help="the trainer's tensor parallelism")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.monotonic()
    # A fresh one-machine cluster (never one another process started here); on a real cluster:
    # ray.init(address=..., namespace=NAMESPACE) and the trainer and engine actors placed there.
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, object_store_memory=256 << 20)
    address = ray.get_runtime_context().gcs_address
    # The trainers' rendezvous, served from here for their whole life. The store binds a port
    # itself: one found free first can be taken by another process before rank 0 binds it.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trainers = start_trainers(args.tp, args.seed, store)
    with tempfile.TemporaryDirectory(prefix="megatron-to-vllm-") as tmp:
        model_dir = write_checkpoint(trainers, Path(tmp) / "step-0")
        oracle = run_engine(model_dir, "auto")  # loads the checkpoint
        expected = ray.get(oracle.generate.remote(PROMPTS))
        ray.get(oracle.shutdown.remote())
        ray.kill(oracle)
        rollout = run_engine(model_dir, "dummy")  # starts with dummy weights: the sync fills them
        before = ray.get(rollout.generate.remote(PROMPTS))
        ranks = register_vllm_actor("rollout", rollout, namespace=NAMESPACE)  # WeightSync
        with InProcessSync(spec_for(address, args.tp)) as sync:  # WeightSync
            report = sync.push("step-0")  # WeightSync
        after = ray.get(rollout.generate.remote(PROMPTS))
        ray.get(rollout.shutdown.remote())
        del ranks
    same_before = sum(b == e for b, e in zip(before, expected, strict=True))
    print(f"synced {report.version}: {report.moved_bytes / 1e6:.2f} MB in {report.seconds:.3f}s")
    print(f"before the sync: {same_before}/{len(PROMPTS)} prompts generate as the checkpoint")
    verdict = "yes" if after == expected else "no"
    print(f"after the sync: generation equals the checkpoint-loaded engine: {verdict}")
    print(f"wall: {time.monotonic() - t0:.1f}s")
    return 0 if after == expected and same_before == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
