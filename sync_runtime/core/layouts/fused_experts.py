"""gpt-oss's layer rules for the `vllm` and `hf` layouts: biased attention with sinks, a biased
router, and routed experts the checkpoint already stores fused.

Checkpoint (transformers' GptOssExperts): `mlp.experts.gate_up_proj` (E, H, 2Im) with gate and up
*interleaved* on the last dim (gate = [..., 0::2], up = [..., 1::2]), `gate_up_proj_bias` (E, 2Im),
`down_proj` (E, Im, H), `down_proj_bias` (E, H). A TP rank's share of the intermediate dim is a
contiguous range [lo, hi) of Im, i.e. columns [2lo, 2hi) of gate_up (whole gate/up pairs): this is
how vLLM 0.32's `GptOssModel._load_weights_other` narrows them. EP: experts e0..e1 of the rank, whole.

vLLM (GptOssForCausalLM's `hf_to_vllm_mapper`): `self_attn.` is `attn.`, the embedding is
`model.embedding.weight`; `attn.sinks` holds the rank's heads; `attn.o_proj.bias` is whole on every
rank (RowParallelLinear adds it on rank 0 only); `mlp.router.{weight,bias}` whole;
`mlp.experts.routed_experts.w13_bias` (E', 2n) and `w2_bias` (E', H), the latter only on TP rank
0 without EP: vLLM's loader zeroes it on the other ranks (the row-parallel reduction adds it once),
so they receive nothing of it and do not hold it here. vLLM's loader permutes the narrowed expert
weights, (E', H, 2n) -> w13_weight (E', 2n, H) and (E', n, H) -> w2_weight (E', H, n); a piece maps
boxes element for element in row-major order and cannot express a transpose, so this layout
declares those two in the checkpoint's orientation (`PERMUTED_LOCALS`). A vLLM rank receives them so
(engines/vllm_family_load.py: it reports the checkpoint-oriented shape, permutes on apply and
zeroes w2_bias off rank 0, as vLLM's loader does).
"""

from __future__ import annotations

from sync_runtime.core.layouts._rules import LayerView, ModelView, ShardBuilder, part, require
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord

VLLM_ATTN = "attn."
VLLM_EMBED = "model.embedding.weight"
VLLM_EXPERTS = "mlp.experts.routed_experts."
PERMUTED_LOCALS: dict[str, tuple[int, ...]] = {"w13_weight": (0, 2, 1), "w2_weight": (0, 2, 1)}
"""vLLM expert tensors this layout declares in the checkpoint's orientation: local name suffix ->
the permutation that gives vLLM's parameter (what the destination must apply)."""

GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
HF_RULES: dict[str, str] = {
    "self_attn.o_proj.bias": "full",
    "self_attn.sinks": "col",
    "mlp.router.weight": "full",
    "mlp.router.bias": "full",
}
"""gpt-oss tensors the hf layout places with its ordinary rules (see hf.RULES)."""
HF_EXPERTS = (GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS)
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def check(view: ModelView, spec: ParallelSpec, layout: str) -> None:
    """What both layouts need beyond the GQA checks: whole KV heads per rank (vLLM's OAIAttention
    divides nkv by tp, so it cannot replicate them) and a split of Im or of E."""
    d, t = view.dims, spec.tp
    require(
        d.num_kv_heads % t == 0,
        layout,
        "model.layers.0.self_attn.k_proj.weight",
        f"nkv={d.num_kv_heads} not divisible by tp={t} (gpt-oss attention cannot replicate KV heads)",
    )
    if spec.ep > 1:
        require(
            d.num_experts % spec.ep == 0, layout, GATE_UP, f"E={d.num_experts} not divisible by ep={spec.ep}"
        )
    else:
        require(
            d.moe_intermediate % t == 0, layout, GATE_UP, f"Im={d.moe_intermediate} not divisible by tp={t}"
        )


def _expert_range(view: ModelView, spec: ParallelSpec, coord: RankCoord) -> tuple[int, int, int, int]:
    """(e0, e1, lo, hi): the rank's experts and its range of the intermediate dim."""
    d = view.dims
    if spec.ep > 1:
        e0, e1 = part(d.num_experts, spec.ep, coord.ep_rank)
        return e0, e1, 0, d.moe_intermediate
    lo, hi = part(d.moe_intermediate, spec.tp, coord.tp_rank)
    return 0, d.num_experts, lo, hi


def _experts(
    out: ShardBuilder,
    dense: dict[str, TensorMeta],
    names: dict[str, str],
    box: tuple[int, int, int, int],
    down_bias: bool = True,
) -> None:
    """The four expert tensors of the rank at `box`, under `names[canonical suffix]`; without
    `down_bias` the rank holds no down_proj_bias (its engine zeroes it)."""
    e0, e1, lo, hi = box
    hidden = dense[GATE_UP].shape[1]
    canon_boxes = {
        GATE_UP: ((e0, e1), (0, hidden), (2 * lo, 2 * hi)),
        GATE_UP_BIAS: ((e0, e1), (2 * lo, 2 * hi)),
        DOWN: ((e0, e1), (lo, hi), (0, hidden)),
        DOWN_BIAS: ((e0, e1), (0, hidden)),
    }
    for suffix, canon in canon_boxes.items():
        if suffix == DOWN_BIAS and not down_bias:
            continue
        t, local = dense[suffix], names[suffix]
        shape = tuple(b - a for a, b in canon)
        out.local(local, shape, t.dtype)
        out.piece(t.name, canon, local, tuple((0, s) for s in shape))


def vllm_layer(
    out: ShardBuilder,
    view: ModelView,
    layer: LayerView,
    dense: dict[str, TensorMeta],
    spec: ParallelSpec,
    coord: RankCoord,
) -> None:
    """Everything of a gpt-oss layer but qkv_proj and o_proj.weight (vllm.py places those)."""
    p, t, r = layer.prefix, spec.tp, coord.tp_rank
    out.full(dense["self_attn.o_proj.bias"], f"{p}{VLLM_ATTN}o_proj.bias")
    out.split(dense["self_attn.sinks"], f"{p}{VLLM_ATTN}sinks", 0, t, r)
    for suffix in ("mlp.router.weight", "mlp.router.bias", *_NORMS):
        out.full(dense[suffix], p + suffix)
    m = p + VLLM_EXPERTS
    names = {
        GATE_UP: m + "w13_weight",
        GATE_UP_BIAS: m + "w13_bias",
        DOWN: m + "w2_weight",
        DOWN_BIAS: m + "w2_bias",
    }
    _experts(out, dense, names, _expert_range(view, spec, coord), down_bias=spec.ep > 1 or r == 0)


def hf_experts(
    out: ShardBuilder,
    view: ModelView,
    layer: LayerView,
    dense: dict[str, TensorMeta],
    spec: ParallelSpec,
    coord: RankCoord,
) -> None:
    """The hf layout's share of the fused experts: canonical names, the rank's experts or Im range
    (down_proj_bias whole on every TP rank, as the hf layout holds row-parallel biases)."""
    names = {s: layer.prefix + s for s in HF_EXPERTS}
    _experts(out, dense, names, _expert_range(view, spec, coord))
