"""Tiny vLLM-compatible models for `weightsync demo --engine vllm`, the tests and the benchmark.

Each is a Hugging Face config vLLM 0.32 builds as is (architectures, rope, norms: every field
vLLM reads is present), small enough for several CPU engines on a 2-core machine. The reference
checkpoint of a model is the demo's canonical weights of (seed, version) written as an HF model
dir; vLLM loading it with `load_format="auto"` is the oracle a synced engine is compared with.
No vLLM import here: the project venv (without vLLM) imports this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.testing.weights import bits_to_torch, reference_weights

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
_SMALL = {
    # The families proven only by tests/engines/test_vllm_families.py: hidden 128, 2 layers,
    # head_dim 32 (the smallest vLLM's CPU attention takes), 4 experts, engines start in ~30 s.
    **_COMMON,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
CONFIGS |= {
    # Biased dense MLP: vLLM's gate_up_proj.bias (column-parallel), down_proj.bias (whole per rank).
    "llama_mlp_bias": {
        **_SMALL,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "mlp_bias": True,
        "rope_theta": 10000.0,
    },
    # Every layer MoE under block_sparse_moe (w1 gate, w3 up, w2 down); intermediate_size is Im.
    "mixtral": {
        **_SMALL,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    # q/k/v biases, qk norm, partial rotary, one dense layer then sigmoid-routed experts with a
    # router bias and one shared expert.
    "glm4_moe": {
        **_SMALL,
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "attention_bias": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
    },
    # Sandwich norms, qk norm, tied embeddings scaled by sqrt(H), a 16-token sliding window on
    # layer 0 (the prompts and their 16 generated tokens run past it) and a global layer 1.
    "gemma3": {
        **_SMALL,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
    # bf16 experts stored fused (gate/up interleaved) with biases, q/k/v/o biases, per-head
    # attention sinks, a biased router, yarn rope (vLLM's GptOssAttention reads its fields) and a
    # 16-token sliding window on layer 0 (vLLM windows the even layers). Im 64: 32 per TP rank.
    "gpt_oss": {
        **_SMALL,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
PRESETS = {
    "vllm-tiny-qwen3": "qwen3",
    "vllm-tiny-qwen3-moe": "qwen3_moe",
    "vllm-tiny-deepseek-v3": "deepseek_v3",
}
"""`--model` names of the vLLM demo (the planning presets lack fields vLLM reads)."""
DEFAULT_VLLM_MODEL = "vllm-tiny-qwen3"
PROMPTS = [[(7 * i + 13 * j) % 997 + 3 for j in range(8 + i)] for i in range(4)]
"""Four prompts of 8-11 token ids."""
MAX_TOKENS = 16


def vllm_model_config(model: str) -> dict[str, Any]:
    """A vLLM demo preset (PRESETS), a CONFIGS key, or any preset / config.json path."""
    key = PRESETS.get(model, model)
    if key in CONFIGS:
        return dict(CONFIGS[key])
    return load_model_config(model)


def write_model(directory: Path, config: dict[str, Any], manifest: Manifest, seed: int, version: str) -> str:
    """An HF model dir: config.json + model.safetensors holding the demo's canonical tensors of
    (seed, version), the same bits the demo's source actors hold shards of. A model with MTP
    layers (`num_nextn_predict_layers` > 0: `manifest.mtp`) gets those too, under the checkpoint's
    names (`model.layers.{L}.*`), seeded like the rest, so a vLLM serving MTP loads its drafter
    from them; without MTP layers the file is what it always was."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    written = manifest.with_mtp() if manifest.mtp else manifest
    weights = {n: bits_to_torch(a) for n, a in reference_weights(written, seed, version).items()}
    save_file({n: t.contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"))
    return str(directory)


def model_dir_for(directory: Path, config: Mapping[str, Any], checkpoint: Path) -> str:
    """An HF model dir whose model.safetensors IS `checkpoint` (a relative symlink: the dump's
    reference.safetensors is what vLLM's normal loader reads, not a copy of it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config)))
    link = directory / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(checkpoint.resolve(), directory.resolve()))
    return str(directory)
