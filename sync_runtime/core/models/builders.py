"""config.json -> `Manifest`: the tensors of the published Hugging Face checkpoint (design §3).

Names and shapes follow the safetensors files as stored (per-expert MoE tensors). Every tensor
has the config's dtype (`dtype`, or `torch_dtype`; bfloat16 when neither is given) unless the
config's `weightsync_tensor_dtypes` says otherwise: the dtype
each canonical tensor has on the wire, i.e. as the source holds it (a Megatron source reports
its live dtypes there, e.g. fp32 norms and router expert_bias in a bf16 model). DeepSeek-V3 and
Kimi-K2 publish FP8 block-quantised weights with `weight_scale_inv` tensors; we model their bf16
equivalents (the form a trainer and a bf16 vLLM deployment hold), without scale tensors.
Tensors the checkpoints store in another dtype than the config's keep it (`CHECKPOINT_DTYPES`:
DeepSeek-V3, Kimi-K2 and GLM-4.5 store the router's `e_score_correction_bias` in F32, and
transformers holds it as an fp32 buffer).
MTP (`num_nextn_predict_layers`) layers of DeepSeek-V3 are the manifest's `mtp` part (part
"mtp"), named as the checkpoint names them: per layer L+k (L = num_hidden_layers)
`embed_tokens` (V, H), `enorm`, `hnorm` (H), `eh_proj` (H, 2H), a decoder layer (MoE by the
family's rule), `shared_head.norm` (H), `shared_head.head` (V, H); a plan sends them only to
destinations that serve MTP. Other families' MTP layers are left out (`not_synced` names them).
A `quantization_config` is refused.
engines/hf_meta.py reads the same tensors from transformers' own model class on the meta device;
tests/test_hf_meta.py checks every preset's manifest against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from sync_runtime.core.manifest import DTYPE_BYTES, MTP_PART, Manifest, TensorMeta
from sync_runtime.core.models.config import (
    MOE_CHECKPOINT_NAMES,
    ModelDims,
    config_dtype,
    model_dims,
    mtp_layers,
)
from sync_runtime.errors import ModelConfigError

DTYPE = "bfloat16"
TENSOR_DTYPES_KEY = "weightsync_tensor_dtypes"
"""Config key: {canonical tensor name: dtype} overriding DTYPE per tensor (not an HF field)."""
CHECKPOINT_DTYPES: dict[str, str] = {"mlp.gate.e_score_correction_bias": "float32"}
"""Name suffix -> the dtype the published checkpoints store it in, whatever the config's dtype."""


def _t(name: str, *shape: int) -> TensorMeta:
    # Built in DTYPE, then set to the config's dtype in one pass (build_manifest).
    return TensorMeta(name, tuple(shape), DTYPE)


def _dense_mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> Iterator[TensorMeta]:
    yield _t(f"{prefix}.gate_proj.weight", inter, hidden)
    if bias:
        yield _t(f"{prefix}.gate_proj.bias", inter)
    yield _t(f"{prefix}.up_proj.weight", inter, hidden)
    if bias:
        yield _t(f"{prefix}.up_proj.bias", inter)
    yield _t(f"{prefix}.down_proj.weight", hidden, inter)
    if bias:
        yield _t(f"{prefix}.down_proj.bias", hidden)


def _gqa_attention(p: str, d: ModelDims) -> Iterator[TensorMeta]:
    q_rows, kv_rows = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    yield _t(f"{p}.self_attn.q_proj.weight", q_rows, d.hidden)
    if d.qkv_bias:
        yield _t(f"{p}.self_attn.q_proj.bias", q_rows)
    yield _t(f"{p}.self_attn.k_proj.weight", kv_rows, d.hidden)
    if d.qkv_bias:
        yield _t(f"{p}.self_attn.k_proj.bias", kv_rows)
    yield _t(f"{p}.self_attn.v_proj.weight", kv_rows, d.hidden)
    if d.qkv_bias:
        yield _t(f"{p}.self_attn.v_proj.bias", kv_rows)
    yield _t(f"{p}.self_attn.o_proj.weight", d.hidden, q_rows)
    if d.o_bias:
        yield _t(f"{p}.self_attn.o_proj.bias", d.hidden)
    if d.attn_sinks:
        yield _t(f"{p}.self_attn.sinks", d.num_heads)
    if d.qk_norm:
        yield _t(f"{p}.self_attn.q_norm.weight", d.head_dim)
        yield _t(f"{p}.self_attn.k_norm.weight", d.head_dim)


def _mla_attention(p: str, d: ModelDims) -> Iterator[TensorMeta]:
    qk_head = d.qk_nope_head_dim + d.qk_rope_head_dim
    if d.q_lora_rank is not None:
        yield _t(f"{p}.self_attn.q_a_proj.weight", d.q_lora_rank, d.hidden)
        yield _t(f"{p}.self_attn.q_a_layernorm.weight", d.q_lora_rank)
        yield _t(f"{p}.self_attn.q_b_proj.weight", d.num_heads * qk_head, d.q_lora_rank)
    else:
        yield _t(f"{p}.self_attn.q_proj.weight", d.num_heads * qk_head, d.hidden)
    yield _t(f"{p}.self_attn.kv_a_proj_with_mqa.weight", d.kv_lora_rank + d.qk_rope_head_dim, d.hidden)
    yield _t(f"{p}.self_attn.kv_a_layernorm.weight", d.kv_lora_rank)
    yield _t(
        f"{p}.self_attn.kv_b_proj.weight",
        d.num_heads * (d.qk_nope_head_dim + d.v_head_dim),
        d.kv_lora_rank,
    )
    yield _t(f"{p}.self_attn.o_proj.weight", d.hidden, d.num_heads * d.v_head_dim)


def _named_moe(p: str, d: ModelDims) -> Iterator[TensorMeta]:
    """A family whose MoE checkpoint names differ (MOE_CHECKPOINT_NAMES): gate, then experts."""
    block, names = MOE_CHECKPOINT_NAMES[d.family]
    ckpt = {canon: own for own, canon in names.items()}
    yield _t(f"{p}.{block}gate.weight", d.num_experts, d.hidden)
    for e in range(d.num_experts):
        expert = f"{p}.{block}experts.{e}."
        for t in _dense_mlp(expert[:-1], d.hidden, d.moe_intermediate):
            yield TensorMeta(expert + ckpt[t.name[len(expert) :]], t.shape, t.dtype)


def _fused_moe(p: str, d: ModelDims) -> Iterator[TensorMeta]:
    """gpt-oss: a biased router, then the experts fused as the checkpoint stores them."""
    e, h, im = d.num_experts, d.hidden, d.moe_intermediate
    yield _t(f"{p}.mlp.router.weight", e, h)
    yield _t(f"{p}.mlp.router.bias", e)
    yield _t(f"{p}.mlp.experts.gate_up_proj", e, h, 2 * im)  # gate, up interleaved on the last dim
    yield _t(f"{p}.mlp.experts.gate_up_proj_bias", e, 2 * im)
    yield _t(f"{p}.mlp.experts.down_proj", e, im, h)
    yield _t(f"{p}.mlp.experts.down_proj_bias", e, h)


def _moe_mlp(p: str, d: ModelDims) -> Iterator[TensorMeta]:
    # HF module order: experts, gate (router), shared_experts (DeepSeek-V3); Qwen3-MoE has
    # gate first, but checkpoint order only fixes iteration order, never names or shapes.
    if d.family in MOE_CHECKPOINT_NAMES:
        yield from _named_moe(p, d)
        return
    if d.fused_experts:
        yield from _fused_moe(p, d)
        return
    if d.family == "qwen3_moe":
        yield _t(f"{p}.mlp.gate.weight", d.num_experts, d.hidden)
    for e in range(d.num_experts):
        yield from _dense_mlp(f"{p}.mlp.experts.{e}", d.hidden, d.moe_intermediate)
    if d.family != "qwen3_moe":
        yield _t(f"{p}.mlp.gate.weight", d.num_experts, d.hidden)
        if d.expert_bias:
            yield _t(f"{p}.mlp.gate.e_score_correction_bias", d.num_experts)
    if d.shared_intermediate:
        yield from _dense_mlp(f"{p}.mlp.shared_experts", d.hidden, d.shared_intermediate)


def _layer(i: int, d: ModelDims) -> Iterator[TensorMeta]:
    p = f"model.layers.{i}"
    yield from (_mla_attention(p, d) if d.mla else _gqa_attention(p, d))
    if i in d.moe_layers:
        yield from _moe_mlp(p, d)
    else:
        yield from _dense_mlp(f"{p}.mlp", d.hidden, d.intermediate, d.mlp_bias)
    yield _t(f"{p}.input_layernorm.weight", d.hidden)
    yield _t(f"{p}.post_attention_layernorm.weight", d.hidden)
    if d.sandwich_norms:
        yield _t(f"{p}.pre_feedforward_layernorm.weight", d.hidden)
        yield _t(f"{p}.post_feedforward_layernorm.weight", d.hidden)


def tensors_of(d: ModelDims) -> Iterator[TensorMeta]:
    """The canonical tensors in state-dict order: embedding, layers, final norm, lm_head."""
    yield _t("model.embed_tokens.weight", d.vocab, d.hidden)
    for i in range(d.num_layers):
        yield from _layer(i, d)
    yield _t("model.norm.weight", d.hidden)
    if not d.tie_embeddings:
        yield _t("lm_head.weight", d.vocab, d.hidden)


def mtp_tensors_of(d: ModelDims, layers: list[tuple[int, bool]]) -> Iterator[TensorMeta]:
    """The MTP part's tensors (part MTP_PART), in the checkpoint's module order per layer."""
    for i, moe in layers:
        p = f"model.layers.{i}"
        layer_dims = dataclasses.replace(d, moe_layers=d.moe_layers | {i} if moe else d.moe_layers)
        tensors = (
            _t(f"{p}.embed_tokens.weight", d.vocab, d.hidden),
            _t(f"{p}.enorm.weight", d.hidden),
            _t(f"{p}.hnorm.weight", d.hidden),
            _t(f"{p}.eh_proj.weight", d.hidden, 2 * d.hidden),
            *_layer(i, layer_dims),
            _t(f"{p}.shared_head.norm.weight", d.hidden),
            _t(f"{p}.shared_head.head.weight", d.vocab, d.hidden),
        )
        yield from (dataclasses.replace(t, part=MTP_PART) for t in tensors)


def build_manifest(config: dict[str, Any]) -> Manifest:
    """The canonical manifest of an HF config dict (see `load_model_config`).

    Raises ModelConfigError for unknown families or missing/unsupported fields.
    """
    dims = model_dims(config)
    dtype = config_dtype(config, ("bfloat16", "float16", "float32"))
    tensors = tuple(_in_checkpoint_dtype(t, dtype) for t in tensors_of(dims))
    mtp = tuple(_in_checkpoint_dtype(t, dtype) for t in mtp_tensors_of(dims, mtp_layers(config)))
    both = _with_dtypes(tensors + mtp, config.get(TENSOR_DTYPES_KEY) or {})
    return Manifest(
        family=dims.family,
        tensors=both[: len(tensors)],
        config=dict(config),
        dtype=dtype,
        mtp=both[len(tensors) :],
    )


def _in_checkpoint_dtype(t: TensorMeta, dtype: str) -> TensorMeta:
    """`t` in the config's dtype, or in the one CHECKPOINT_DTYPES gives its name."""
    for suffix, own in CHECKPOINT_DTYPES.items():
        if t.name.endswith(suffix):
            dtype = own
    return t if t.dtype == dtype else dataclasses.replace(t, dtype=dtype)


def _with_dtypes(tensors: tuple[TensorMeta, ...], dtypes: dict[str, str]) -> tuple[TensorMeta, ...]:
    names = {t.name for t in tensors}
    for name, dtype in dtypes.items():
        if name not in names:
            raise ModelConfigError(f"{TENSOR_DTYPES_KEY}: {name!r} is not a tensor of this model")
        if dtype not in DTYPE_BYTES:
            raise ModelConfigError(
                f"{TENSOR_DTYPES_KEY}: {name}: dtype {dtype!r} unknown (known: {', '.join(DTYPE_BYTES)})"
            )
    return tuple(dataclasses.replace(t, dtype=dtypes[t.name]) if t.name in dtypes else t for t in tensors)
