"""The `vllm` layout (design §4.1), destination side, per replica: TP size t, PP size p, EP = t or off,
or vLLM's wide EP (DP size d, EP = t*d, p = 1): experts by `coord.ep_rank` over t*d, everything
else by `coord.tp_rank` over t, identical on every DP rank.

Fused tensors and their order, as vLLM's loaders build them (`stacked_params_mapping`):
- `self_attn.qkv_proj.{weight,bias}` = [q heads r-th of t; k heads; v heads], KV heads
  replicated when t > nkv (`kv_head_range`).
- `mlp.gate_up_proj.weight` = [gate rows r-th of t; up rows r-th of t]; also for DeepSeek's
  `mlp.shared_experts.gate_up_proj.weight` (shared experts are a TP-sharded dense MLP).
- `mlp.experts.routed_experts.w13_weight` [E, 2Im/t, H] (no EP) or [E/t, 2Im, H] (EP, experts
  of coord.ep_rank over ep = t or t*d, vLLM's "linear" placement); `mlp.experts.routed_experts.w2_weight`
  [E, H, Im/t] or [E/t, H, Im] (vLLM 0.32 names: the FusedMoE module is `experts.routed_experts`).
- `mlp.gate.e_score_correction_bias` (DeepSeek): vLLM holds it in float32 and loads the
  checkpoint's values by copy; it is one Parameter, also reachable from the experts module.
- MLA (deepseek_v3): with q_lora_rank, `self_attn.fused_qkv_a_proj.weight` = [q_a_proj;
  kv_a_proj_with_mqa], replicated (vLLM's DeepseekV2MLAAttention, `mla_params_mapping`);
  without it, q_proj is column-parallel and kv_a_proj_with_mqa replicated. q_b_proj and kv_b_proj
  are column-parallel over heads, o_proj row-parallel, the a-side layernorms full copies.
Embedding and lm_head: rows r-th of t over V padded to a multiple of 64, padding rows uncovered
(zero). Tied embeddings: lm_head is absent when p == 1, else cut from the embedding on the last
stage (vLLM's lm_head then *is* embed_tokens.weight, it never holds its own copy). MLA's
`mla_attn.W_UV`/`W_UK_T` are derived from kv_b_proj after loading and never synced. Names and
per-rank shapes are those vLLM 0.32 reports from its pre-load metadata
(engines/vllm_apply.engine_tensors; tests/engines/test_vllm_*.py check them against a live
engine). Layer names keep global indices; stage ranges come from `stage_layer_ranges`.
gpt-oss (biased attention with sinks, fused biased experts): layouts/fused_experts.py.
MTP layers (a `Manifest.with_mtp()`, one layer): on the last stage, under the names of vLLM 0.32's
drafter (DeepSeekMTP) prefixed DRAFTER: the block as `model.layers.{L}.mtp_block.*` in the fused
forms above, `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}`; the MTP layer's
`embed_tokens` and `shared_head.head` not at all (vLLM's drafter uses the target's embedding
and lm_head: layouts/mtp.py, SHARED_WITH_TARGET).
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
    check_coverage,
    kv_head_range,
    part,
    require,
    require_stage_split,
    round_up,
)
from sync_runtime.core.layouts.base import Piece, RankShard
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, stage_layer_ranges

NAME = "vllm"
VOCAB_MULTIPLE = 64
EXPERTS = "mlp.experts.routed_experts."
"""vLLM 0.32's FusedMoE module path inside a MoE block (Qwen3-MoE and DeepSeek alike)."""
DRAFTER = "drafter."
"""Local-name prefix of the MTP drafter's parameters (vLLM's DeepSeekMTP, a model of its own)."""
MOE_BLOCK: dict[str, str] = {"mixtral": "block_sparse_moe."}
"""Families whose vLLM MoE block is not `mlp.` (vLLM's MixtralDecoderLayer.block_sparse_moe)."""


def _moe_local(view: ModelView, suffix: str) -> str:
    """The vLLM suffix of a canonical `mlp.` MoE suffix (router, experts) for this family."""
    block = MOE_BLOCK.get(view.dims.family)
    return block + suffix[len("mlp.") :] if block and suffix.startswith("mlp.") else suffix


# Tensors held whole under their canonical suffix.
_FULL = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.kv_a_layernorm.weight",
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
)


def _check_parallel(spec: ParallelSpec) -> None:
    """vLLM's axes: no virtual stages, experts by tp or ep, a DP axis inside a replica only as
    wide EP (experts over the tp ranks of every DP engine, no pipeline stages)."""
    t, wide = spec.tp, spec.tp * spec.dp
    require(spec.vpp == 1, NAME, "vpp", f"vpp={spec.vpp}: vLLM has no virtual pipeline stages")
    require(spec.etp == 1, NAME, "etp", f"etp={spec.etp}: vLLM shards experts by tp or ep only")
    require(spec.ep in (1, t, wide), NAME, "ep", f"ep={spec.ep} must be 1, tp={t} or tp*dp={wide}")
    require(
        spec.dp == 1 or (spec.ep == wide and spec.pp == 1),
        NAME,
        "dp",
        f"dp={spec.dp}: data parallel inside a replica is wide EP only (ep=tp*dp={wide}, pp=1)",
    )


def _validate(view: ModelView, spec: ParallelSpec) -> None:
    d, t = view.dims, spec.tp
    require_stage_split(d.num_layers, spec, NAME)
    attn = "model.layers.0.self_attn."
    _check_parallel(spec)
    if d.mla:
        q = attn + ("q_b_proj.weight" if d.q_lora_rank else "q_proj.weight")
        require(d.num_heads % t == 0, NAME, q, f"nh={d.num_heads} not divisible by tp={t}")
    else:
        require(
            d.num_heads % t == 0, NAME, attn + "q_proj.weight", f"nh={d.num_heads} not divisible by tp={t}"
        )
        nkv = d.num_kv_heads
        require(
            t % nkv == 0 or nkv % t == 0,
            NAME,
            attn + "k_proj.weight",
            f"nkv={nkv} and tp={t}: one must divide the other",
        )
    vp = round_up(d.vocab, VOCAB_MULTIPLE)
    require(vp % t == 0, NAME, EMBED, f"padded vocab Vp={vp} not divisible by tp={t}")
    if len(d.moe_layers) < d.num_layers:
        require(
            d.intermediate % t == 0,
            NAME,
            "mlp.gate_proj.weight",
            f"I={d.intermediate} not divisible by tp={t}",
        )
    if d.moe_layers and spec.ep > 1:
        require(
            d.num_experts % spec.ep == 0,
            NAME,
            EXPERTS + "w13_weight",
            f"E={d.num_experts} not divisible by ep={spec.ep}",
        )
    elif d.moe_layers:
        require(
            d.moe_intermediate % t == 0,
            NAME,
            EXPERTS + "w13_weight",
            f"Im={d.moe_intermediate} not divisible by tp={t}",
        )
    if d.shared_intermediate:
        require(
            d.shared_intermediate % t == 0,
            NAME,
            "mlp.shared_experts.gate_up_proj.weight",
            f"shared intermediate {d.shared_intermediate} not divisible by tp={t}",
        )
    if d.fused_experts:
        fused_experts.check(view, spec, NAME)
    check_coverage(view, NAME, lambda out, layer, dense: _layer(out, view, layer, dense, spec, _ZERO))
    mtp.check(view, NAME, lambda out, layer, dense: _layer(out, view, layer, dense, spec, _ZERO))


# Layer rules read the same tensors on every rank; coverage is proven once, on this coordinate.
_ZERO = RankCoord(role=Role.DESTINATION)


def _qkv(
    out: ShardBuilder, view: ModelView, p: str, dense: dict[str, TensorMeta], t: int, r: int, attn: str
) -> None:
    d = view.dims
    q0, q1 = part(d.num_heads, t, r)
    k0, k1 = kv_head_range(d.num_kv_heads, t, r)
    for kind in ("weight", "bias"):
        if f"self_attn.q_proj.{kind}" not in dense:
            continue
        q, k, v = (dense[f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        hd = d.head_dim
        out.concat_rows(
            f"{p}{attn}qkv_proj.{kind}",
            [(q, q0 * hd, q1 * hd), (k, k0 * hd, k1 * hd), (v, k0 * hd, k1 * hd)],
        )


def _mla(out: ShardBuilder, p: str, dense: dict[str, TensorMeta], t: int, r: int) -> None:
    a = "self_attn."
    if "self_attn.q_a_proj.weight" in dense:
        q_a, kv_a = dense[a + "q_a_proj.weight"], dense[a + "kv_a_proj_with_mqa.weight"]
        out.concat_rows(f"{p}{a}fused_qkv_a_proj.weight", [(q_a, 0, q_a.shape[0]), (kv_a, 0, kv_a.shape[0])])
        out.split(dense[a + "q_b_proj.weight"], f"{p}{a}q_b_proj.weight", 0, t, r)
    else:
        out.full(dense[a + "kv_a_proj_with_mqa.weight"], f"{p}{a}kv_a_proj_with_mqa.weight")
        out.split(dense[a + "q_proj.weight"], f"{p}{a}q_proj.weight", 0, t, r)
    out.split(dense[a + "kv_b_proj.weight"], f"{p}{a}kv_b_proj.weight", 0, t, r)


def _gate_up(out: ShardBuilder, p: str, sub: str, dense: dict[str, TensorMeta], t: int, r: int) -> None:
    """`{sub}gate_up_proj` = [gate rows r-th of t; up rows r-th of t] and `{sub}down_proj` columns."""
    gate, up, down = (dense[f"{sub}{x}_proj.weight"] for x in ("gate", "up", "down"))
    lo, hi = part(gate.shape[0], t, r)
    out.concat_rows(f"{p}{sub}gate_up_proj.weight", [(gate, lo, hi), (up, lo, hi)])
    out.split(down, f"{p}{sub}down_proj.weight", 1, t, r)
    if f"{sub}gate_proj.bias" in dense:  # mlp_bias: column-parallel biases fused; row-parallel full
        gate_b, up_b = dense[f"{sub}gate_proj.bias"], dense[f"{sub}up_proj.bias"]
        out.concat_rows(f"{p}{sub}gate_up_proj.bias", [(gate_b, lo, hi), (up_b, lo, hi)])
        out.full(dense[f"{sub}down_proj.bias"], f"{p}{sub}down_proj.bias")


def _experts(
    out: ShardBuilder, p: str, layer: LayerView, spec: ParallelSpec, coord: RankCoord, module: str = EXPERTS
) -> None:
    experts = layer.experts
    gate0 = experts[0]["gate_proj.weight"]
    im, hidden, dtype = gate0.shape[0], gate0.shape[1], gate0.dtype
    w13, w2 = f"{p}{module}w13_weight", f"{p}{module}w2_weight"
    if spec.ep > 1:
        e0, e1 = part(len(experts), spec.ep, coord.ep_rank)
        lo, hi = 0, im
    else:
        e0, e1 = 0, len(experts)
        lo, hi = part(im, spec.tp, coord.tp_rank)
    n = hi - lo
    out.local(w13, (e1 - e0, 2 * n, hidden), dtype)
    out.local(w2, (e1 - e0, hidden, n), dtype)
    # Hot path (Kimi-K2: ~70k expert pieces per replica): boxes are shared by all experts of the
    # layer and pieces are built directly, not through the generic helpers.
    full_h = (0, hidden)
    canon_rows, canon_cols = ((lo, hi), full_h), (full_h, (lo, hi))
    gate_rows, up_rows, w2_rest = (0, n), (n, 2 * n), (full_h, (0, n))
    pieces = out.pieces
    for k, e in enumerate(range(e0, e1)):
        lead = (k, k + 1)
        tensors = experts[e]
        pieces.append(Piece(tensors["gate_proj.weight"].name, canon_rows, w13, (lead, gate_rows, full_h)))
        pieces.append(Piece(tensors["up_proj.weight"].name, canon_rows, w13, (lead, up_rows, full_h)))
        pieces.append(Piece(tensors["down_proj.weight"].name, canon_cols, w2, (lead, *w2_rest)))


def _layer(
    out: ShardBuilder,
    view: ModelView,
    layer: LayerView,
    dense: dict[str, TensorMeta],
    spec: ParallelSpec,
    coord: RankCoord,
) -> None:
    p, t, r = layer.prefix, spec.tp, coord.tp_rank
    attn = fused_experts.VLLM_ATTN if view.dims.fused_experts else "self_attn."
    if view.dims.mla:
        _mla(out, p, dense, t, r)
    else:
        _qkv(out, view, p, dense, t, r, attn)
    out.split(dense["self_attn.o_proj.weight"], f"{p}{attn}o_proj.weight", 1, t, r)
    if view.dims.fused_experts:  # gpt-oss: the rest of its layer has rules of its own
        fused_experts.vllm_layer(out, view, layer, dense, spec, coord)
        return
    if "mlp.gate_proj.weight" in dense:
        _gate_up(out, p, "mlp.", dense, t, r)
    if "mlp.shared_experts.gate_proj.weight" in dense:
        _gate_up(out, p, "mlp.shared_experts.", dense, t, r)
    if layer.experts:
        _experts(out, p, layer, spec, coord, _moe_local(view, EXPERTS))
    for suffix in _FULL:
        if suffix in dense:
            out.full(dense[suffix], p + _moe_local(view, suffix))


def _build(view: ModelView, spec: ParallelSpec, coord: RankCoord) -> RankShard:
    out = ShardBuilder()
    stages = stage_layer_ranges(view.dims.num_layers, spec.pp, spec.layer_counts)
    first, last = coord.pp_rank == 0, coord.pp_rank == spec.pp - 1
    t, r = spec.tp, coord.tp_rank
    vp = round_up(view.dims.vocab, VOCAB_MULTIPLE)
    embed = fused_experts.VLLM_EMBED if view.dims.fused_experts else EMBED
    if first:
        out.vocab_rows(view.top[EMBED], embed, vp, t, r)
    for i in stages[coord.pp_rank]:
        layer = view.layers[i]
        _layer(out, view, layer, layer.dense, spec, coord)
    if last:
        out.full(view.top[FINAL_NORM], FINAL_NORM)
        if LM_HEAD in view.top:
            out.vocab_rows(view.top[LM_HEAD], LM_HEAD, vp, t, r)
        elif spec.pp > 1:
            # Tied, several stages: vLLM's last stage builds its own embedding for the head to tie
            # to (LlamaModel/Qwen2Model: `embed_tokens` on the first rank, and on the last when
            # tie_word_embeddings), and lm_head shares its parameter, which the engine reports
            # under the embedding's name (vLLM 0.32 CPU, PP 2: tests/engines/test_vllm_pp.py).
            out.vocab_rows(view.top[EMBED], embed, vp, t, r)
        mtp.place(
            out,
            view,
            lambda o, layer, dense: _layer(o, view, layer, dense, spec, coord),
            lambda layer: f"{DRAFTER}{layer.prefix}mtp_block.",
            lambda layer, suffix: f"{DRAFTER}{layer.prefix}{suffix}",
            None,  # embed_tokens, shared_head.head: the target's (SHARED_WITH_TARGET)
        )
    return out.done(coord)


class VllmLayout(RuleLayout):
    name = NAME
    places_mtp = True
    mtp_shared = mtp.SHARED_WITH_TARGET
    check = staticmethod(_validate)
    build = staticmethod(_build)
