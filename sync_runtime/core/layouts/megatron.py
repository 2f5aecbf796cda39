"""The `megatron` layout (DESIGN 4.2), source side: TP t, PP p (+ VPP v), DP, EP ep, ETP etp.

Names are Megatron-Core's (TE spec), with local layer indices j inside each model chunk:
- GQA: `self_attention.linear_qkv.{weight,bias}` grouped per query group g (rank r holds groups
  r-th of t of nkv): [q heads of g; k_g; v_g]; `linear_qkv.layer_norm_weight` = input_layernorm;
  `q_layernorm`/`k_layernorm` = q_norm/k_norm; `linear_proj` = o_proj (columns).
- MLA (names as Megatron-Bridge maps DeepSeek-V3): `input_layernorm.weight`;
  `linear_q_down_proj` = q_a_proj and `linear_kv_down_proj` = kv_a_proj_with_mqa (duplicated on
  every TP rank); `linear_q_up_proj` = q_b_proj and `linear_kv_up_proj` = kv_b_proj
  (rows r-th of t), their `.layer_norm_weight` = q_a_layernorm / kv_a_layernorm. Without
  q_lora_rank: `linear_q_proj` = q_proj (rows) and `linear_q_proj.layer_norm_weight` =
  input_layernorm.
- Dense MLP: `mlp.linear_fc1.weight` = [gate r-th; up r-th], `.layer_norm_weight` =
  post_attention_layernorm, `mlp.linear_fc2.weight` = down (columns).
- MoE layer: `pre_mlp_layernorm.weight` = post_attention_layernorm; `mlp.router.weight` (+
  `mlp.router.expert_bias` = e_score_correction_bias); `mlp.shared_experts.linear_fc1/linear_fc2`
  TP-sharded like a dense MLP; expert e on EP rank e // (E/ep) as `mlp.experts.linear_fc1.weight{k}`
  ([gate; up] rows etp_rank-th of etp) and `mlp.experts.linear_fc2.weight{k}` (columns), k = e % (E/ep).
- Embedding / output layer: rows r-th of t over V padded to a multiple of 128*t, padding zero.
  Tied: the chunk holding the output layer keeps a copy `output_layer.weight` of the embedding
  (an alternative sender) unless it also holds the embedding (p*v == 1), as Megatron does.
VPP: chunk c of stage s holds block b = c*p + s, names prefixed `chunk{c}.` when v > 1. Blocks have
L/(p*v) layers (L % (p*v) != 0 is an error), or, with explicit per-stage `layer_counts`, stage s's
blocks have layer_counts[s]/v layers each (each count must divide by v), in block order.
EP/ETP ranks come from the reported coordinate (coord.ep_rank, coord.etp_rank); DP ranks and
expert-DP ranks hold identical copies.
"""

from __future__ import annotations

from collections.abc import Hashable

from sync_runtime.core.layouts._rules import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    LayerView,
    ModelView,
    RuleLayout,
    ShardBuilder,
    check_coverage,
    part,
    require,
    round_up,
)
from sync_runtime.core.layouts.base import LocalTensorMeta, Piece, RankShard
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, stage_layer_ranges
from sync_runtime.errors import LayoutError, TopologyError

NAME = "megatron"
VOCAB_MULTIPLE_PER_TP = 128

# Canonical suffix -> Megatron suffix for tensors held whole; MLP-side names depend on the layer kind.
_FULL_ATTN = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
}
# Canonical suffix -> Megatron suffix for column-parallel (rows r-th of t) tensors.
_ROWS = {
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
}


def chunk_ranges(num_layers: int, spec: ParallelSpec) -> list[list[range]]:
    """Global layer range of every (stage, chunk): result[s][c] (see module docstring for VPP)."""
    p, v = spec.pp, spec.vpp
    if v == 1:
        return [[r] for r in stage_layer_ranges(num_layers, p, spec.layer_counts)]
    if spec.layer_counts is None:
        if num_layers % (p * v) != 0:
            raise LayoutError(
                f"{NAME}: vpp: L={num_layers} layers not divisible by pp*vpp={p * v} "
                "(give per-stage layer_counts divisible by vpp for an uneven split)"
            )
        sizes = [num_layers // (p * v)] * p
    else:
        if sum(spec.layer_counts) != num_layers:
            raise LayoutError(f"{NAME}: layer_counts: sum {sum(spec.layer_counts)} != L={num_layers}")
        bad = [c for c in spec.layer_counts if c % v]
        if bad:
            raise LayoutError(
                f"{NAME}: layer_counts: {list(spec.layer_counts)} must each be divisible by vpp={v}"
            )
        sizes = [c // v for c in spec.layer_counts]
    out: list[list[range]] = [[] for _ in range(p)]
    start = 0
    for b in range(p * v):
        s = b % p
        out[s].append(range(start, start + sizes[s]))
        start += sizes[s]
    return out


class MegatronLayout(RuleLayout):
    name = NAME

    def check(self, view: ModelView, spec: ParallelSpec) -> None:
        _validate(view, spec)

    def build(self, view: ModelView, spec: ParallelSpec, coord: RankCoord) -> RankShard:
        return _build(view, spec, coord)

    def shard_key(self, view: ModelView, spec: ParallelSpec, coord: RankCoord) -> Hashable:
        moe = bool(view.dims.moe_layers)
        return (coord.pp_rank, coord.tp_rank, coord.ep_rank if moe else 0, coord.etp_rank if moe else 0)


def _validate(view: ModelView, spec: ParallelSpec) -> None:
    d, t = view.dims, spec.tp
    try:
        chunk_ranges(d.num_layers, spec)
    except TopologyError as e:
        raise LayoutError(f"{NAME}: pp: {e}") from e
    attn = "model.layers.0.self_attn."
    require(
        d.num_heads % t == 0,
        NAME,
        attn + ("q_b_proj.weight" if d.mla else "q_proj.weight"),
        f"nh={d.num_heads} not divisible by tp={t}",
    )
    if not d.mla:
        require(
            d.num_kv_heads % t == 0,
            NAME,
            attn + "k_proj.weight",
            f"nkv={d.num_kv_heads} not divisible by tp={t} (query groups cannot be replicated)",
        )
    if len(d.moe_layers) < d.num_layers:
        require(
            d.intermediate % t == 0,
            NAME,
            "mlp.gate_proj.weight",
            f"I={d.intermediate} not divisible by tp={t}",
        )
    if d.moe_layers:
        require(
            d.num_experts % spec.ep == 0,
            NAME,
            "mlp.experts",
            f"E={d.num_experts} not divisible by ep={spec.ep}",
        )
        require(
            d.moe_intermediate % spec.etp == 0,
            NAME,
            "mlp.experts.gate_proj.weight",
            f"Im={d.moe_intermediate} not divisible by etp={spec.etp}",
        )
        require(
            (t * spec.dp) % (spec.ep * spec.etp) == 0,
            NAME,
            "ep",
            f"ep*etp={spec.ep * spec.etp} does not divide tp*dp={t * spec.dp}",
        )
    if d.shared_intermediate:
        require(
            d.shared_intermediate % t == 0,
            NAME,
            "mlp.shared_experts.gate_proj.weight",
            f"shared intermediate {d.shared_intermediate} not divisible by tp={t}",
        )
    check_coverage(view, NAME, lambda out, layer, dense: _layer(out, view, layer, dense, "", spec, _ZERO))


# Layer rules read the same tensors on every rank; coverage is proven once, on this coordinate.
_ZERO = RankCoord(role=Role.SOURCE)


def _qkv(out: ShardBuilder, view: ModelView, p: str, dense: dict[str, TensorMeta], t: int, r: int) -> None:
    d = view.dims
    g0, g1 = part(d.num_kv_heads, t, r)
    per_group, hd = d.num_heads // d.num_kv_heads, d.head_dim
    for kind in ("weight", "bias"):
        if f"self_attn.q_proj.{kind}" not in dense:
            continue
        q, k, v = (dense[f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        segments: list[tuple[TensorMeta, int, int]] = []
        for g in range(g0, g1):
            segments += [
                (q, g * per_group * hd, (g + 1) * per_group * hd),
                (k, g * hd, (g + 1) * hd),
                (v, g * hd, (g + 1) * hd),
            ]
        out.concat_rows(f"{p}self_attention.linear_qkv.{kind}", segments)


def _fc1(out: ShardBuilder, local: str, gate: TensorMeta, up: TensorMeta, parts: int, index: int) -> None:
    lo, hi = part(gate.shape[0], parts, index)
    out.concat_rows(local, [(gate, lo, hi), (up, lo, hi)])


def _attention(
    out: ShardBuilder, view: ModelView, p: str, dense: dict[str, TensorMeta], t: int, r: int
) -> None:
    norm = dense["input_layernorm.weight"]
    if not view.dims.mla:
        out.full(norm, f"{p}self_attention.linear_qkv.layer_norm_weight")
        _qkv(out, view, p, dense, t, r)
    elif "self_attn.q_proj.weight" in dense:  # MLA without q_lora_rank: TE fuses the input norm into q
        out.full(norm, f"{p}self_attention.linear_q_proj.layer_norm_weight")
        out.split(dense["self_attn.q_proj.weight"], f"{p}self_attention.linear_q_proj.weight", 0, t, r)
    else:
        out.full(norm, f"{p}input_layernorm.weight")
    out.split(dense["self_attn.o_proj.weight"], f"{p}self_attention.linear_proj.weight", 1, t, r)
    for canon, local in _ROWS.items():
        if canon in dense:
            out.split(dense[canon], p + local, 0, t, r)


def _experts(out: ShardBuilder, p: str, layer: LayerView, spec: ParallelSpec, coord: RankCoord) -> None:
    e0, e1 = part(len(layer.experts), spec.ep, coord.ep_rank)
    gate0 = layer.experts[0]["gate_proj.weight"]
    hidden, dtype = gate0.shape[1], gate0.dtype
    lo, hi = part(gate0.shape[0], spec.etp, coord.etp_rank)
    n = hi - lo
    # Hot path (Kimi-K2: ~70k expert tensors): boxes and shapes are shared by all experts of the
    # layer and pieces are built directly, not through the generic helpers.
    full_h = (0, hidden)
    canon_rows, canon_cols = ((lo, hi), full_h), (full_h, (lo, hi))
    gate_box, up_box, fc2_box = ((0, n), full_h), ((n, 2 * n), full_h), (full_h, (0, n))
    fc1_shape, fc2_shape = (2 * n, hidden), (hidden, n)
    tensors, pieces = out.tensors, out.pieces
    for k, e in enumerate(range(e0, e1)):
        expert = layer.experts[e]
        fc1, fc2 = f"{p}mlp.experts.linear_fc1.weight{k}", f"{p}mlp.experts.linear_fc2.weight{k}"
        tensors.append(LocalTensorMeta(fc1, fc1_shape, dtype))
        tensors.append(LocalTensorMeta(fc2, fc2_shape, dtype))
        pieces.append(Piece(expert["gate_proj.weight"].name, canon_rows, fc1, gate_box))
        pieces.append(Piece(expert["up_proj.weight"].name, canon_rows, fc1, up_box))
        pieces.append(Piece(expert["down_proj.weight"].name, canon_cols, fc2, fc2_box))


def _layer(
    out: ShardBuilder,
    view: ModelView,
    layer: LayerView,
    dense: dict[str, TensorMeta],
    p: str,
    spec: ParallelSpec,
    coord: RankCoord,
) -> None:
    t, r = spec.tp, coord.tp_rank
    _attention(out, view, p, dense, t, r)
    post_norm = dense["post_attention_layernorm.weight"]
    if "mlp.gate_proj.weight" in dense:
        out.full(post_norm, f"{p}mlp.linear_fc1.layer_norm_weight")
        _fc1(
            out, f"{p}mlp.linear_fc1.weight", dense["mlp.gate_proj.weight"], dense["mlp.up_proj.weight"], t, r
        )
        out.split(dense["mlp.down_proj.weight"], f"{p}mlp.linear_fc2.weight", 1, t, r)
    else:
        out.full(post_norm, f"{p}pre_mlp_layernorm.weight")
    if "mlp.shared_experts.gate_proj.weight" in dense:
        s = "mlp.shared_experts."
        _fc1(
            out, f"{p}{s}linear_fc1.weight", dense[s + "gate_proj.weight"], dense[s + "up_proj.weight"], t, r
        )
        out.split(dense[s + "down_proj.weight"], f"{p}{s}linear_fc2.weight", 1, t, r)
    if layer.experts:
        _experts(out, p, layer, spec, coord)
    for canon, local in _FULL_ATTN.items():
        if canon in dense:
            out.full(dense[canon], p + local)


def _build(view: ModelView, spec: ParallelSpec, coord: RankCoord) -> RankShard:
    out = ShardBuilder()
    chunks = chunk_ranges(view.dims.num_layers, spec)[coord.pp_rank]
    t, r = spec.tp, coord.tp_rank
    vp = round_up(view.dims.vocab, VOCAB_MULTIPLE_PER_TP * t)
    last_chunk = len(chunks) - 1
    for c, layers in enumerate(chunks):
        prefix = f"chunk{c}." if spec.vpp > 1 else ""
        pre = coord.pp_rank == 0 and c == 0
        post = coord.pp_rank == spec.pp - 1 and c == last_chunk
        if pre:
            out.vocab_rows(view.top[EMBED], f"{prefix}embedding.word_embeddings.weight", vp, t, r)
        for j, i in enumerate(layers):
            layer = view.layers[i]
            _layer(out, view, layer, layer.dense, f"{prefix}decoder.layers.{j}.", spec, coord)
        if post:
            out.full(view.top[FINAL_NORM], f"{prefix}decoder.final_layernorm.weight")
            if LM_HEAD in view.top:
                out.vocab_rows(view.top[LM_HEAD], f"{prefix}output_layer.weight", vp, t, r)
            elif not pre:  # tied: a copy of the embedding, identical bytes
                out.vocab_rows(view.top[EMBED], f"{prefix}output_layer.weight", vp, t, r)
    return out.done(coord)
