"""The `hf` layout (design §4.3): canonical names, full tensors, or TP-sharded unfused tensors.

tp == 1: every rank of a replica holds its stage's tensors whole (exact canonical shapes, no
vocab padding). tp > 1: the column/row rules of design §4.1 applied to the unfused tensors:
q/k/v (KV heads replicated when tp > nkv), gate/up, q_b/kv_b are split by rows; o_proj and
down projections by columns; embedding and lm_head by rows over V padded to a multiple of 64
(padding rows uncovered, i.e. zero); everything else is a full copy. Routed experts: with
ep == tp, expert e lives whole on ep rank e // (E/ep); without EP each expert is split like a
dense MLP. PP stages hold layer ranges as in `stage_layer_ranges`. DP ranks hold identical copies.
gpt-oss's fused experts: layouts/fused_experts.py. MTP layers (a `Manifest.with_mtp()`): under
their canonical names on the last stage, the decoder block by the rules above (layouts/mtp.py).
"""

from __future__ import annotations

from sync_runtime.core.layouts import fused_experts, mtp
from sync_runtime.core.layouts._rules import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    LayerView,
    ModelView,
    RuleLayout,
    ShardBuilder,
    kv_head_range,
    part,
    require,
    require_stage_split,
    round_up,
)
from sync_runtime.core.layouts.base import RankShard
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, stage_layer_ranges

NAME = "hf"
VOCAB_MULTIPLE = 64

# Suffix (after `model.layers.{i}.`) -> how a TP rank holds it. "col": rows r-th of t,
# "row": columns r-th of t, "kv": rows of the rank's KV heads (replicated when t > nkv), "full".
RULES: dict[str, str] = {
    "self_attn.q_proj.weight": "col",
    "self_attn.q_proj.bias": "col",
    "self_attn.k_proj.weight": "kv",
    "self_attn.k_proj.bias": "kv",
    "self_attn.v_proj.weight": "kv",
    "self_attn.v_proj.bias": "kv",
    "self_attn.o_proj.weight": "row",
    "self_attn.q_norm.weight": "full",
    "self_attn.k_norm.weight": "full",
    "self_attn.q_a_proj.weight": "full",
    "self_attn.q_a_layernorm.weight": "full",
    "self_attn.q_b_proj.weight": "col",
    "self_attn.kv_a_proj_with_mqa.weight": "full",
    "self_attn.kv_a_layernorm.weight": "full",
    "self_attn.kv_b_proj.weight": "col",
    "mlp.gate_proj.weight": "col",
    "mlp.up_proj.weight": "col",
    "mlp.down_proj.weight": "row",
    "mlp.gate_proj.bias": "col",
    "mlp.up_proj.bias": "col",
    "mlp.down_proj.bias": "full",
    "mlp.gate.weight": "full",
    "mlp.gate.e_score_correction_bias": "full",
    "mlp.shared_experts.gate_proj.weight": "col",
    "mlp.shared_experts.up_proj.weight": "col",
    "mlp.shared_experts.down_proj.weight": "row",
    "input_layernorm.weight": "full",
    "post_attention_layernorm.weight": "full",
    "pre_feedforward_layernorm.weight": "full",
    "post_feedforward_layernorm.weight": "full",
    **fused_experts.HF_RULES,
}


def _validate(view: ModelView, spec: ParallelSpec) -> None:
    d, t = view.dims, spec.tp
    require_stage_split(d.num_layers, spec, NAME)
    for layer in view.layers:
        for suffix in layer.dense:
            if suffix in fused_experts.HF_EXPERTS:
                continue
            require(suffix in RULES, NAME, layer.prefix + suffix, "no rule of this layout covers the tensor")
    require(spec.ep in (1, t), NAME, "ep", f"ep={spec.ep} must be 1 or equal to tp={t}")
    if d.num_experts and spec.ep > 1:
        require(
            d.num_experts % spec.ep == 0,
            NAME,
            "mlp.experts",
            f"E={d.num_experts} not divisible by ep={spec.ep}",
        )
    if d.fused_experts:
        fused_experts.check(view, spec, NAME)
    mtp.check(view, NAME, lambda out, layer, dense: _mtp_block(out, view, layer, dense, spec, _ZERO))
    if t == 1:
        return
    q_name = "model.layers.0.self_attn." + (
        "q_proj.weight" if not d.mla or not d.q_lora_rank else "q_b_proj.weight"
    )
    require(d.num_heads % t == 0, NAME, q_name, f"nh={d.num_heads} not divisible by tp={t}")
    if not d.mla:
        require(
            t % d.num_kv_heads == 0 or d.num_kv_heads % t == 0,
            NAME,
            "model.layers.0.self_attn.k_proj.weight",
            f"nkv={d.num_kv_heads} and tp={t}: one must divide the other",
        )
    require(
        round_up(d.vocab, VOCAB_MULTIPLE) % t == 0,
        NAME,
        EMBED,
        f"padded vocab {round_up(d.vocab, VOCAB_MULTIPLE)} not divisible by tp={t}",
    )
    require(
        d.intermediate % t == 0, NAME, "mlp.gate_proj.weight", f"I={d.intermediate} not divisible by tp={t}"
    )
    if d.num_experts and spec.ep == 1:
        require(
            d.moe_intermediate % t == 0,
            NAME,
            "mlp.experts.gate_proj.weight",
            f"Im={d.moe_intermediate} not divisible by tp={t}",
        )
    if d.shared_intermediate:
        require(
            d.shared_intermediate % t == 0,
            NAME,
            "mlp.shared_experts.gate_proj.weight",
            f"shared intermediate {d.shared_intermediate} not divisible by tp={t}",
        )


# Layer rules read the same tensors on every rank; coverage is proven once, on this coordinate.
_ZERO = RankCoord(role=Role.DESTINATION)


def _mtp_block(
    out: ShardBuilder,
    view: ModelView,
    layer: LayerView,
    dense: dict[str, TensorMeta],
    spec: ParallelSpec,
    coord: RankCoord,
) -> None:
    """An MTP layer's decoder block: every tensor by RULES (no fused experts: DeepSeek-V3 only)."""
    for suffix in list(dense):
        if suffix in RULES:
            _place(out, dense[suffix], RULES[suffix], spec, coord.tp_rank, view)
    _experts(out, view, layer, spec, coord)


def _place(out: ShardBuilder, t: TensorMeta, rule: str, spec: ParallelSpec, r: int, view: ModelView) -> None:
    tp = spec.tp
    if rule == "full" or tp == 1:
        out.full(t, t.name)
    elif rule == "col":
        out.split(t, t.name, 0, tp, r)
    elif rule == "row":
        out.split(t, t.name, 1, tp, r)
    else:  # "kv": rows of whole heads, possibly replicated
        nkv = view.dims.num_kv_heads
        h0, h1 = kv_head_range(nkv, tp, r)
        d = t.shape[0] // nkv
        canon = ((h0 * d, h1 * d), *((0, s) for s in t.shape[1:]))
        shape = ((h1 - h0) * d, *t.shape[1:])
        out.local(t.name, shape, t.dtype)
        out.piece(t.name, canon, t.name, tuple((0, s) for s in shape))


def _experts(
    out: ShardBuilder, view: ModelView, layer: LayerView, spec: ParallelSpec, coord: RankCoord
) -> None:
    n = len(layer.experts)
    if spec.ep > 1:
        lo, hi = part(n, spec.ep, coord.ep_rank)
        for e in range(lo, hi):
            for t in layer.experts[e].values():
                out.full(t, t.name)
        return
    for tensors in layer.experts:
        for suffix, t in tensors.items():
            _place(out, t, "row" if suffix == "down_proj.weight" else "col", spec, coord.tp_rank, view)


def _build(view: ModelView, spec: ParallelSpec, coord: RankCoord) -> RankShard:
    out = ShardBuilder()
    stages = stage_layer_ranges(view.dims.num_layers, spec.pp, spec.layer_counts)
    first, last = coord.pp_rank == 0, coord.pp_rank == spec.pp - 1
    r = coord.tp_rank
    padded = round_up(view.dims.vocab, VOCAB_MULTIPLE)
    if first:
        _vocab(out, view.top[EMBED], spec, r, padded)
    for i in stages[coord.pp_rank]:
        layer = view.layers[i]
        for suffix, t in layer.dense.items():
            if suffix not in fused_experts.HF_EXPERTS:
                _place(out, t, RULES[suffix], spec, r, view)
        if view.dims.fused_experts:
            fused_experts.hf_experts(out, view, layer, layer.dense, spec, coord)
        _experts(out, view, layer, spec, coord)
    if last:
        out.full(view.top[FINAL_NORM], FINAL_NORM)
        if LM_HEAD in view.top:
            _vocab(out, view.top[LM_HEAD], spec, r, padded)
        mtp.place(
            out,
            view,
            lambda o, layer, dense: _mtp_block(o, view, layer, dense, spec, coord),
            lambda layer: layer.prefix,
            lambda layer, suffix: layer.prefix + suffix,
            lambda t, name: _vocab(out, t, spec, r, padded),
        )
    return out.done(coord)


def _vocab(out: ShardBuilder, t: TensorMeta, spec: ParallelSpec, r: int, padded: int) -> None:
    if spec.tp == 1:
        out.full(t, t.name)
    else:
        out.vocab_rows(t, t.name, padded, spec.tp, r)


class HfLayout(RuleLayout):
    name = NAME
    places_mtp = True
    check = staticmethod(_validate)
    build = staticmethod(_build)
