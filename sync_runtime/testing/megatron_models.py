"""Real Megatron-Core GPT models from a Hugging Face config, on CPU over gloo (demo, tests, bench).

`megatron_config` maps the config.json fields of the families Megatron-Core builds (llama/
qwen2/qwen3 with or without Llama's mlp_bias, qwen3_moe, mixtral, glm4_moe, deepseek_v3, gpt_oss)
onto a TransformerConfig for the local spec; `build_chunks` builds one GPTModel per VPP chunk with
Megatron's seeded initialisation. gemma3_text is refused in one line
(engines.megatron.MEGATRON_SOURCE_REFUSES says why). The CPU workarounds live in
`sync_runtime.engines.megatron_cpu` (gpt-oss's forward needs `sliding_window_mask_on_cpu`).
gpt-oss is built with plain RoPE, not its YaRN (TransformerConfig has no YaRN fields; no weight
depends on it): the forward-equivalence test tells transformers the same.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from sync_runtime.core.layouts._rules import round_up
from sync_runtime.core.layouts.megatron import VOCAB_MULTIPLE_PER_TP
from sync_runtime.core.models import ModelDims, model_dims
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines import megatron_cpu
from sync_runtime.engines.megatron import refuse_unsupported_family
from sync_runtime.errors import TopologyError


def init_parallel(spec: ParallelSpec, seed: int, *, default_etp: bool = False) -> None:
    """Megatron's parallel state over the already initialised default (gloo) group, seeded.
    `default_etp`: Megatron's own expert TP size (= TP), as a trainer that does not set it has."""
    megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=None if default_etp else spec.etp,
    )
    # The inference RNG tracker avoids torch.cuda RNG state calls (CPU).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)


SIGMOID_ROUTER_SCALE: dict[str, float] = {"deepseek_v3": 2.5, "glm4_moe": 1.0}
"""Families routing by sigmoid scores (noaux_tc: no aux loss, top-k renormalised, then scaled by
`routed_scaling_factor`), with HF's default factor. Others (qwen3_moe, mixtral) route softmax over
the top-k logits, which equals HF's softmax -> top-k -> renormalise."""


def _moe(d: ModelDims, config: Mapping[str, Any]) -> dict[str, Any]:
    sigmoid = d.family in SIGMOID_ROUTER_SCALE
    scale = float(config.get("routed_scaling_factor") or SIGMOID_ROUTER_SCALE[d.family]) if sigmoid else None
    kw: dict[str, Any] = {
        **megatron_cpu.CPU_MOE_CONFIG,
        "num_moe_experts": d.num_experts,
        "moe_ffn_hidden_size": d.moe_intermediate,
        "moe_router_topk": int(config.get("num_experts_per_tok") or 2),
        "moe_layer_freq": [1 if i in d.moe_layers else 0 for i in range(d.num_layers)],
        "moe_router_load_balancing_type": "none" if sigmoid else "aux_loss",
        "moe_aux_loss_coeff": 0.0 if sigmoid else 1e-2,
        "moe_router_enable_expert_bias": d.expert_bias,
        "moe_router_score_function": "sigmoid" if sigmoid else "softmax",
        "moe_router_pre_softmax": False,
        "moe_router_topk_scaling_factor": scale,
    }
    if d.expert_bias:
        kw["moe_router_bias_update_rate"] = 1e-3
    if d.shared_intermediate:
        kw["moe_shared_expert_intermediate_size"] = d.shared_intermediate
    return kw


def _gpt_oss(config: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss in Megatron-Core's own terms: biased q/k/v/o, router and experts; learnable sinks
    (`core_attention.softmax_offset`); HF's clamped GLU `(up + 1) * gate * sigmoid(1.702 * gate)`
    = quick_gelu with glu_linear_offset=1 and the clamp at swiglu_limit; sliding-window layers
    where `layer_types` says so (Megatron's per-layer list, 1 = windowed)."""
    from megatron.core.activations import quick_gelu

    types = list(config.get("layer_types") or [])
    return {
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "softmax_type": "learnable",
        "activation_func": quick_gelu,
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(config.get("swiglu_limit") or 7.0),
        # transformers keeps kv > q - sliding_window (the query and sliding_window - 1 before it);
        # Megatron's window (left, 0) keeps kv >= q - left.
        "window_size": (int(config["sliding_window"]) - 1, 0) if types else None,
        "window_attn_skip_freq": [int(t == "sliding_attention") for t in types] or None,
    }


def stage_sizes(spec: ParallelSpec) -> dict[str, int]:
    """Explicit uneven PP stages as Megatron-Core's own settings: a first and a last stage size,
    the stages between equal (TopologyError for any other split)."""
    counts = spec.layer_counts
    if not counts or len(set(counts)) == 1:
        return {}
    if len(set(counts[1:-1])) > 1:
        raise TopologyError(
            f"layers={'+'.join(map(str, counts))}: Megatron-Core sets a first and a last stage "
            "size, the stages between hold equal counts"
        )
    return {"num_layers_in_first_pipeline_stage": counts[0], "num_layers_in_last_pipeline_stage": counts[-1]}


def megatron_config(
    config: Mapping[str, Any],
    spec: ParallelSpec,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    *,
    default_etp: bool = False,
) -> Any:
    """The TransformerConfig (MLATransformerConfig for deepseek_v3) of an HF config."""
    refuse_unsupported_family(config)  # before Megatron is imported
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    d = model_dims(dict(config))
    kw: dict[str, Any] = {
        **megatron_cpu.CPU_CONFIG,
        "num_layers": d.num_layers,
        "hidden_size": d.hidden,
        "num_attention_heads": d.num_heads,
        "num_query_groups": d.num_kv_heads,
        "kv_channels": d.head_dim,
        "ffn_hidden_size": d.intermediate,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps") or 1e-6),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": d.qkv_bias,
        "qk_layernorm": d.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": spec.tp,
        "pipeline_model_parallel_size": spec.pp,
        "virtual_pipeline_model_parallel_size": spec.vpp if spec.vpp > 1 else None,
        **stage_sizes(spec),
        "expert_model_parallel_size": spec.ep,
        "expert_tensor_parallel_size": None if default_etp else spec.etp,
        "init_method_std": init_std,
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "pipeline_dtype": dtype,
        "attention_softmax_in_fp32": True,
    }
    if d.moe_layers:
        kw.update(_moe(d, config))
    if d.family == "gpt_oss":
        kw.update(_gpt_oss(config))
    if not d.mla:
        return TransformerConfig(**kw)
    kw.update(
        multi_latent_attention=True,
        q_lora_rank=d.q_lora_rank,
        kv_lora_rank=d.kv_lora_rank,
        qk_head_dim=d.qk_nope_head_dim,
        qk_pos_emb_head_dim=d.qk_rope_head_dim,
        v_head_dim=d.v_head_dim,
        kv_channels=d.v_head_dim,  # DotProductAttention reshapes its output with kv_channels*nh
        rope_type="rope",  # as HF without rope scaling (Megatron's default is yarn)
        qk_layernorm=True,  # the local spec builds q/kv_layernorm only with qk_layernorm
    )
    return MLATransformerConfig(**kw)


def padded_vocab(config: Mapping[str, Any], tp: int) -> int:
    """The caller pads the vocabulary (GPTModel takes the size it is given): Megatron's rule."""
    return round_up(model_dims(dict(config)).vocab, VOCAB_MULTIPLE_PER_TP * tp)


def layer_spec(d: ModelDims, tconfig: Any, vp_stage: int | None) -> Any:
    """The local (no Transformer Engine) layer spec of the model `d`, runnable on CPU (MLA's core
    attention replaced: megatron_cpu)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not (d.moe_layers or d.mla):
        spec = get_gpt_layer_local_spec(qk_layernorm=d.qk_norm, normalization="RMSNorm")
        if d.mlp_bias:  # Llama's mlp_bias: biases in the MLP only (add_bias_linear is global)
            # 0.19's local spec holds the MLP as partial(MLP.as_mlp_submodule, submodules=...).
            local = spec.submodules.mlp
            spec.submodules.mlp = functools.partial(biased_mlp().as_mlp_submodule, **local.keywords)
        return spec
    spec = get_gpt_decoder_block_spec(
        tconfig, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    if d.mla:
        attention = megatron_cpu.mla_core_attention()
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = attention
    return spec


def biased_mlp() -> type:
    """Megatron's MLP with `add_bias_linear` on for its own two linears only: the config flag
    would also bias linear_qkv and linear_proj, which a Llama with mlp_bias does not have."""
    from megatron.core.transformer.mlp import MLP

    class BiasedMLP(MLP):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            own = copy.copy(config)  # a shallow copy: __post_init__ is not rerun
            own.add_bias_linear = True
            super().__init__(own, *args, **kwargs)

    return BiasedMLP


def build_chunks(
    config: Mapping[str, Any], tconfig: Any, *, vocab_size: int | None = None
) -> list[torch.nn.Module]:
    """One GPTModel per VPP chunk of this rank (Megatron's model list), seeded random init."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    d = model_dims(dict(config))
    vpp = tconfig.virtual_pipeline_model_parallel_size
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    vocab = vocab_size or padded_vocab(config, tconfig.tensor_model_parallel_size)
    chunks = []
    for c in range(vpp or 1):
        vp_stage = c if vpp else None
        with megatron_cpu.tensor_cuda_noop(d.tie_embeddings and pp > 1):
            chunks.append(
                GPTModel(
                    config=tconfig,
                    transformer_layer_spec=layer_spec(d, tconfig, vp_stage),
                    vocab_size=vocab,
                    max_sequence_length=64,
                    pre_process=pp_rank == 0 and c == 0,
                    post_process=pp_rank == pp - 1 and c == (vpp or 1) - 1,
                    share_embeddings_and_output_weights=d.tie_embeddings,
                    position_embedding_type="rope",
                    rotary_base=int(config.get("rope_theta") or 10000),
                    # GLM-4.5 rotates the first partial_rotary_factor of each head (rotate-half).
                    rotary_percent=float(config.get("partial_rotary_factor") or 1.0),
                    vp_stage=vp_stage,
                )
            )
    return chunks
