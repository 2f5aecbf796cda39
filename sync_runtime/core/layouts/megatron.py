"""The `megatron` and `megatron-te` layouts (design §4.2, corrected to Megatron-Core 0.19.2), source side.

TP t, PP p (+ VPP v), DP, EP ep, ETP etp. Names are those of a live `GPTModel.named_parameters()`
(plus the persistent buffer `mlp.router.expert_bias`), with local layer indices j inside each
model chunk. Two naming schemes, one per layout, because the spec a model is built with decides
its names (the engine reports which one it holds):
- `megatron`: the local spec (`get_gpt_layer_local_spec` / `get_gpt_decoder_block_spec(
  use_transformer_engine=False)`), the one that runs without Transformer Engine. Norms are
  modules of their own: `input_layernorm.weight`, `pre_mlp_layernorm.weight` (dense AND MoE
  layers), MLA `self_attention.q_layernorm.weight` / `kv_layernorm.weight`. Routed experts are
  `mlp.experts.local_experts.{k}.linear_fc{1,2}.weight` (SequentialMLP). MLA down-projections
  `linear_q_down_proj` / `linear_kv_down_proj` are ColumnParallelLinear: rows r-th of t (the
  kv_down split cuts across the [kv_lora; rope] boundary: Megatron gathers it in forward).
- `megatron-te`: the Transformer Engine spec. Norms fused into the next linear:
  `linear_qkv.layer_norm_weight` (= input_layernorm), `mlp.linear_fc1.layer_norm_weight` (dense
  post_attention_layernorm; MoE layers keep `pre_mlp_layernorm.weight`), MLA
  `linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`; MLA
  down-projections duplicated on every TP rank (TELinear parallel_mode="duplicated"); routed
  experts grouped, `mlp.experts.linear_fc1.weight{k}` / `linear_fc2.weight{k}` (TEGroupedMLP).
Common to both:
- GQA: `self_attention.linear_qkv.{weight,bias}` grouped per query group g (rank r holds groups
  r-th of t of nkv): [q heads of g; k_g; v_g]; `q_layernorm`/`k_layernorm` = q_norm/k_norm;
  `linear_proj` = o_proj (columns r-th of t).
- MLA: `linear_q_up_proj` = q_b_proj, `linear_kv_up_proj` = kv_b_proj (rows r-th of t); without
  q_lora_rank `linear_q_proj` = q_proj (rows).
- MLP `linear_fc1` = [gate rows r-th of t; up rows r-th of t] (Megatron's partition_stride=2),
  `linear_fc2` = down (columns); shared experts the same under `mlp.shared_experts.`; router
  `mlp.router.weight` full (+ `mlp.router.expert_bias` = e_score_correction_bias, fp32 buffer).
  Expert e lives on EP rank e // (E/ep) as local expert k = e % (E/ep), [gate; up] rows
  etp_rank-th of etp and down columns etp_rank-th of etp.
- Embedding / output layer: rows r-th of t over V padded to a multiple of 128*t (the caller
  pads; GPTModel takes the padded size), padding rows not synced. Tied: the chunk holding the
  output layer keeps a copy `output_layer.weight` of the embedding (an alternative sender)
  unless it also holds the embedding (p*v == 1), as Megatron does.
PP: Megatron requires L % p == 0 unless explicit per-stage counts are given (ParallelSpec
`layer_counts`, Megatron's `num_layers_in_first/last_pipeline_stage` or layout string); it never
gives extra layers to the first stages. VPP: chunk c of stage s holds block b = c*p + s; blocks
have L/(p*v) layers, or with `layer_counts` stage s's blocks have layer_counts[s]/v layers each.
The `chunk{c}.` name prefix (v > 1) is OUR convention: Megatron keeps chunks as separate
GPTModel objects in a list, without a prefix; the engine adds it.
EP/ETP ranks come from the reported coordinate (coord.ep_rank, coord.etp_rank); DP ranks and
expert-DP ranks hold identical copies. The split itself: layouts/megatron_stages.py.
MTP layers (a `Manifest.with_mtp()`, GPTModel.mtp): layouts/megatron_mtp.py. gpt-oss's fused
experts (local spec only), held in the checkpoint's orientation: layouts/megatron_gpt_oss.py.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from sync_runtime.core.layouts import megatron_gpt_oss, megatron_mtp
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
from sync_runtime.core.layouts.megatron_stages import NAME, chunk_ranges
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.errors import LayoutError, TopologyError

TE_NAME = "megatron-te"
VOCAB_MULTIPLE_PER_TP = 128


@dataclass(frozen=True, slots=True)
class Naming:
    """What differs between the local and the Transformer Engine spec (see module docstring)."""

    layout: str
    input_norm: str
    """Where input_layernorm lives in a GQA layer (and an MLA layer with q_lora_rank)."""
    dense_post_norm: str
    """Where post_attention_layernorm lives in a dense layer (MoE layers: pre_mlp_layernorm)."""
    q_a_norm: str
    kv_a_norm: str
    mla_down_split: bool
    """MLA q/kv down-projections rows r-th of t (local spec) or full on every TP rank (TE)."""
    expert_fc1: str
    """Name of local expert k's fc1 inside `mlp.experts.` ({k} is formatted in)."""
    expert_fc2: str


LOCAL = Naming(
    layout=NAME,
    input_norm="input_layernorm.weight",
    dense_post_norm="pre_mlp_layernorm.weight",
    q_a_norm="self_attention.q_layernorm.weight",
    kv_a_norm="self_attention.kv_layernorm.weight",
    mla_down_split=True,
    expert_fc1="local_experts.{k}.linear_fc1.weight",
    expert_fc2="local_experts.{k}.linear_fc2.weight",
)
TE = Naming(
    layout=TE_NAME,
    input_norm="self_attention.linear_qkv.layer_norm_weight",
    dense_post_norm="mlp.linear_fc1.layer_norm_weight",
    q_a_norm="self_attention.linear_q_up_proj.layer_norm_weight",
    kv_a_norm="self_attention.linear_kv_up_proj.layer_norm_weight",
    mla_down_split=False,
    expert_fc1="linear_fc1.weight{k}",
    expert_fc2="linear_fc2.weight{k}",
)

# Canonical suffix -> Megatron suffix for tensors held whole by every TP rank (both specs).
_FULL = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.router.weight": "mlp.router.weight",  # gpt-oss's router, biased (add_bias_linear)
    "mlp.router.bias": "mlp.router.bias",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",  # RowParallelLinear: whole
}
# Canonical suffix -> Megatron suffix for per-head tensors (rows r-th of t: the rank's heads).
_HEADS = {"self_attn.sinks": "self_attention.core_attention.softmax_offset"}
# Canonical suffix -> Megatron suffix for column-parallel (rows r-th of t) tensors.
_ROWS = {
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
}
_MLA_DOWN = {
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
}


class MegatronLayout(RuleLayout):
    """A Megatron-Core source; `naming` picks the spec's names (LOCAL: `megatron`, TE: `megatron-te`)."""

    places_mtp = True  # GPTModel.mtp (layouts/megatron_mtp.py)

    def __init__(self, naming: Naming = LOCAL) -> None:
        super().__init__()
        self.naming = naming
        self.name = naming.layout

    def check(self, view: ModelView, spec: ParallelSpec) -> None:
        _validate(view, spec, self.naming)

    def build(self, view: ModelView, spec: ParallelSpec, coord: RankCoord) -> RankShard:
        megatron_mtp.refuse_destination(view, coord, self.name)
        key = ("stage", coord.pp_rank, coord.tp_rank)
        stage = self._cache.part(view, spec, key, lambda: _stage(view, spec, coord, self.naming))
        return _build(spec, coord, self.naming, stage)

    def shard_key(self, view: ModelView, spec: ParallelSpec, coord: RankCoord) -> Hashable:
        moe = bool(view.dims.moe_layers)
        at = (coord.pp_rank, coord.tp_rank, coord.ep_rank if moe else 0, coord.etp_rank if moe else 0)
        return (*at, coord.role) if view.mtp else at  # a destination of MTP is refused, not cached


def _divisible(n: int, t: int, subject: str, what: str, layout: str) -> None:
    require(n % t == 0, layout, subject, f"{what}={n} not divisible by tp={t}")


def _validate(view: ModelView, spec: ParallelSpec, naming: Naming) -> None:
    d, t, name = view.dims, spec.tp, naming.layout
    require(not d.sandwich_norms, name, d.model_type, "no Megatron-Core layer spec holds Gemma 3's norms")
    if d.fused_experts:
        megatron_gpt_oss.check(naming is TE, name, d.model_type, spec)
    try:
        chunk_ranges(d.num_layers, spec)
    except TopologyError as e:
        raise LayoutError(f"{name}: pp: {e}") from e
    attn = "model.layers.0.self_attn."
    _divisible(d.num_heads, t, attn + ("q_b_proj.weight" if d.mla else "q_proj.weight"), "nh", name)
    if not d.mla:
        require(
            d.num_kv_heads % t == 0,
            name,
            attn + "k_proj.weight",
            f"nkv={d.num_kv_heads} not divisible by tp={t} (query groups cannot be replicated)",
        )
    elif naming.mla_down_split:  # ColumnParallelLinear divides its output rows exactly
        if d.q_lora_rank is not None:
            _divisible(d.q_lora_rank, t, attn + "q_a_proj.weight", "q_lora_rank", name)
        kv_rows = d.kv_lora_rank + d.qk_rope_head_dim
        _divisible(kv_rows, t, attn + "kv_a_proj_with_mqa.weight", "kv_lora_rank+qk_rope_head_dim", name)
    if len(d.moe_layers) < d.num_layers:
        _divisible(d.intermediate, t, "mlp.gate_proj.weight", "I", name)
    if d.moe_layers:
        e, im = d.num_experts, d.moe_intermediate
        require(e % spec.ep == 0, name, "mlp.experts", f"E={e} not divisible by ep={spec.ep}")
        require(
            im % spec.etp == 0,
            name,
            "mlp.experts.gate_proj.weight",
            f"Im={im} not divisible by etp={spec.etp}",
        )
        require(
            (t * spec.cp * spec.dp) % (spec.ep * spec.etp) == 0,
            name,
            "ep",
            f"ep*etp={spec.ep * spec.etp} does not divide tp*cp*dp={t * spec.cp * spec.dp}",
        )
    if d.shared_intermediate:
        _divisible(
            d.shared_intermediate, t, "mlp.shared_experts.gate_proj.weight", "shared intermediate", name
        )

    def rule(out: ShardBuilder, layer: LayerView, dense: dict[str, TensorMeta]) -> None:
        _layer(out, view, layer, dense, "", spec, _ZERO, naming, [])

    check_coverage(view, name, rule)
    megatron_mtp.check(view, spec, name, rule)


# Layer rules read the same tensors on every rank; coverage is proven once, on this coordinate.
_ZERO = RankCoord(role=Role.SOURCE)
Slot = tuple[int, int, str, LayerView, tuple[TensorMeta, ...]]
"""Where a layer's routed experts go in its stage's shard: the tensor and piece counts before
them, the layer's name prefix, the layer, its fused experts (gpt-oss; else empty)."""
Stage = tuple[RankShard, list[Slot]]


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


def _mla(out: ShardBuilder, p: str, dense: dict[str, TensorMeta], t: int, r: int, naming: Naming) -> None:
    norm = dense["input_layernorm.weight"]
    if "self_attn.q_proj.weight" in dense:  # no q_lora_rank: TE fuses the input norm into q
        fused = naming is TE
        out.full(
            norm,
            f"{p}self_attention.linear_q_proj.layer_norm_weight" if fused else f"{p}input_layernorm.weight",
        )
        out.split(dense["self_attn.q_proj.weight"], f"{p}self_attention.linear_q_proj.weight", 0, t, r)
    else:
        out.full(norm, f"{p}input_layernorm.weight")
        out.full(dense["self_attn.q_a_layernorm.weight"], p + naming.q_a_norm)
    out.full(dense["self_attn.kv_a_layernorm.weight"], p + naming.kv_a_norm)
    for canon, local in _MLA_DOWN.items():
        if canon in dense:
            out.split(dense[canon], p + local, 0, t if naming.mla_down_split else 1, r)
    for canon, local in _ROWS.items():
        if canon in dense:
            out.split(dense[canon], p + local, 0, t, r)


def _attention(
    out: ShardBuilder, view: ModelView, p: str, dense: dict[str, TensorMeta], t: int, r: int, naming: Naming
) -> None:
    if view.dims.mla:
        _mla(out, p, dense, t, r, naming)
    else:
        out.full(dense["input_layernorm.weight"], p + naming.input_norm)
        _qkv(out, view, p, dense, t, r)
        for canon, local in _HEADS.items():
            if canon in dense:
                out.split(dense[canon], p + local, 0, t, r)
    out.split(dense["self_attn.o_proj.weight"], f"{p}self_attention.linear_proj.weight", 1, t, r)


def _experts(
    out: ShardBuilder, p: str, layer: LayerView, spec: ParallelSpec, coord: RankCoord, naming: Naming
) -> None:
    e0, e1 = part(len(layer.experts), spec.ep, coord.ep_rank)
    gate0 = layer.experts[0]["gate_proj.weight"]
    hidden = gate0.shape[1]
    lo, hi = part(gate0.shape[0], spec.etp, coord.etp_rank)
    n = hi - lo
    # Hot path (Kimi-K2: ~70k expert tensors): boxes and shapes are shared by all experts of the
    # layer and pieces are built directly, not through the generic helpers.
    full_h = (0, hidden)
    canon_rows, canon_cols = ((lo, hi), full_h), (full_h, (lo, hi))
    gate_box, up_box, fc2_box = ((0, n), full_h), ((n, 2 * n), full_h), (full_h, (0, n))
    fc1_shape, fc2_shape = (2 * n, hidden), (hidden, n)
    fc1_name, fc2_name = f"{p}mlp.experts.{naming.expert_fc1}", f"{p}mlp.experts.{naming.expert_fc2}"
    tensors, pieces = out.tensors, out.pieces
    for k, e in enumerate(range(e0, e1)):
        expert = layer.experts[e]
        fc1, fc2 = fc1_name.format(k=k), fc2_name.format(k=k)
        # Each expert tensor keeps its own dtype (a bf16 model may hold experts in another).
        tensors.append(LocalTensorMeta(fc1, fc1_shape, expert["gate_proj.weight"].dtype))
        tensors.append(LocalTensorMeta(fc2, fc2_shape, expert["down_proj.weight"].dtype))
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
    naming: Naming,
    slots: list[Slot],
) -> None:
    t, r = spec.tp, coord.tp_rank
    _attention(out, view, p, dense, t, r, naming)
    post_norm = dense["post_attention_layernorm.weight"]
    if "mlp.gate_proj.weight" in dense:
        out.full(post_norm, p + naming.dense_post_norm)
    else:
        out.full(post_norm, f"{p}pre_mlp_layernorm.weight")
    for sub in ("mlp.", "mlp.shared_experts."):  # dense MLP, DeepSeek's shared experts
        for kind in ("weight", "bias"):  # mlp_bias: fc1's bias cut like its rows, fc2's bias full
            if f"{sub}gate_proj.{kind}" in dense:
                gate, up, down = (dense[f"{sub}{x}_proj.{kind}"] for x in ("gate", "up", "down"))
                _fc1(out, f"{p}{sub}linear_fc1.{kind}", gate, up, t, r)
                dim, parts, index = (1, t, r) if kind == "weight" else (0, 1, 0)
                out.split(down, f"{p}{sub}linear_fc2.{kind}", dim, parts, index)
    fused = tuple(dense[s] for s in megatron_gpt_oss.FUSED) if view.dims.fused_experts else ()
    if layer.experts or fused:
        slots.append((len(out.tensors), len(out.pieces), p, layer, fused))
    for canon, local in _FULL.items():
        if canon in dense:
            out.full(dense[canon], p + local)


def _stage(view: ModelView, spec: ParallelSpec, coord: RankCoord, naming: Naming) -> Stage:
    """What every rank of `coord`'s stage and TP rank holds but routed experts (the same on all
    its EP ranks: built once for them), and the slots their experts go in."""
    out = ShardBuilder()
    slots: list[Slot] = []
    chunks = chunk_ranges(view.dims.num_layers, spec)[coord.pp_rank]
    t, r = spec.tp, coord.tp_rank
    vp = round_up(view.dims.vocab, VOCAB_MULTIPLE_PER_TP * t)
    last_chunk = len(chunks) - 1
    for c, layers in enumerate(chunks):
        prefix = f"chunk{c}." if spec.vpp > 1 else ""  # our convention, not Megatron's (see above)
        pre = coord.pp_rank == 0 and c == 0
        post = coord.pp_rank == spec.pp - 1 and c == last_chunk
        if pre:
            out.vocab_rows(view.top[EMBED], f"{prefix}embedding.word_embeddings.weight", vp, t, r)
        for j, i in enumerate(layers):
            layer = view.layers[i]
            _layer(out, view, layer, layer.dense, f"{prefix}decoder.layers.{j}.", spec, coord, naming, slots)
        if post:
            out.full(view.top[FINAL_NORM], f"{prefix}decoder.final_layernorm.weight")
            if LM_HEAD in view.top:
                out.vocab_rows(view.top[LM_HEAD], f"{prefix}output_layer.weight", vp, t, r)
            elif not pre and view.mtp:  # tied, MTP stage: GPTModel projects with its embedding copy
                out.local(f"{prefix}output_layer.weight", (vp // t, view.dims.hidden), view.top[EMBED].dtype)
            elif not pre:  # tied: a copy of the embedding, identical bytes
                out.vocab_rows(view.top[EMBED], f"{prefix}output_layer.weight", vp, t, r)
            megatron_mtp.place(
                out,
                view,
                lambda o, mtp, dense: _layer(o, view, mtp, dense, mtp.prefix, spec, coord, naming, slots),
                prefix,
                vp,
                coord,
                spec,
                first_chunk=pre,
                own_output=LM_HEAD in view.top,
            )
    return out.done(coord), slots


def _build(spec: ParallelSpec, coord: RankCoord, naming: Naming, stage: Stage) -> RankShard:
    """`coord`'s shard: its stage's shard with `coord`'s routed experts in their slots."""
    dense, slots = stage
    out = ShardBuilder()
    t0 = p0 = 0
    for t1, p1, prefix, layer, fused in slots:
        out.tensors.extend(dense.tensors[t0:t1])
        out.pieces.extend(dense.pieces[p0:p1])
        if fused:
            megatron_gpt_oss.experts(out, prefix, fused, spec, coord)
        else:
            _experts(out, prefix, layer, spec, coord, naming)
        t0, p0 = t1, p1
    out.tensors.extend(dense.tensors[t0:])
    out.pieces.extend(dense.pieces[p0:])
    return out.done(coord)
