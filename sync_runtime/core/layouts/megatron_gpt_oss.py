"""gpt-oss's routed experts under the `megatron` layout (local spec), and how a source reorients them.

Megatron-Core 0.19.2 (SequentialMLP, `add_bias_linear`) holds local expert k (global e) of a
layer as `mlp.experts.local_experts.{k}.linear_fc1.weight` (2Im, H) = [gate rows; up rows],
`linear_fc1.bias` (2Im,) the same way, `linear_fc2.weight` (H, Im) and `linear_fc2.bias` (H,):
whole, since biased experts require etp=1 (TransformerConfig.__post_init__ asserts "Bias in Moe is
only supported when ETP==1"; EP splits the experts, TP the attention). The checkpoint stores them
fused (layouts/fused_experts.py): gate_up (E, H, 2Im) with gate/up *interleaved* on the last dim,
down (E, Im, H). A piece maps a box element for element in row-major order and cannot transpose,
but what the rank holds of each is one box of the canonical tensor: gate_up [e], gate_up_bias
[e], down [e], down_bias [e]. So this layout declares the four local tensors in the checkpoint's
orientation, the box's shape (a leading unit dim for e), and `REORIENTED` says how a Megatron-Core
source turns its live parameter into that tensor and back (engines/megatron_reorient.py):
bit-exact index permutations, no arithmetic. (A vLLM destination's TP rank then reads whole
gate/up pairs, columns [2lo, 2hi) of gate_up, out of the box.) It is the mirror of the vLLM side,
whose destination permutes what it received in the checkpoint's orientation
(fused_experts.PERMUTED_LOCALS).

The rest of a gpt-oss layer is ordinary table data of layouts/megatron.py: q/k/v weights and
biases in `linear_qkv`, o_proj's bias `linear_proj.bias` whole (RowParallelLinear), the sinks
`self_attention.core_attention.softmax_offset` (the rank's heads), the router `mlp.router.weight`
and `.bias` whole. Sliding/full attention alternation has no weights. The Transformer Engine spec
(`megatron-te`) is refused: its sink and grouped-bias parameters were not checked here (no TE).
"""

from __future__ import annotations

from dataclasses import dataclass

from sync_runtime.core.layouts._rules import ShardBuilder, part, require
from sync_runtime.core.layouts.base import Box, box_shape, full_box
from sync_runtime.core.layouts.fused_experts import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord

LOCAL_OF = {
    GATE_UP: "linear_fc1.weight",
    GATE_UP_BIAS: "linear_fc1.bias",
    DOWN: "linear_fc2.weight",
    DOWN_BIAS: "linear_fc2.bias",
}
"""The layer's fused expert tensors (canonical suffix) -> local expert k's tensor holding box [e]."""
FUSED = tuple(LOCAL_OF)
"""The fused expert tensors, in the order `experts` takes them."""
TE_REFUSAL = (
    "no megatron-te rule for gpt-oss: Transformer Engine's softmax_offset and grouped expert "
    "biases were not checked against Megatron-Core 0.19.2 (use the local spec, layout megatron)"
)

ETP_REFUSAL = "Megatron-Core 0.19.2 builds biased experts (gpt-oss) only with etp=1"


@dataclass(frozen=True, slots=True)
class Reorient:
    """How the live parameter of shape S becomes the local tensor the layout declares.

    View S as `(2, S[0] // 2, *S[1:])` when `halves` (Megatron's [gate; up] on dim 0), permute by
    `perm`, then, when `halves`, merge the last two dims (Im, 2): gate/up interleaved as the
    checkpoint stores them; finally a leading unit dim, the expert index of the (E, ...) tensor."""

    halves: bool
    perm: tuple[int, ...]


EXPERT_PREFIX = "mlp.experts.local_experts."
REORIENTED: dict[str, Reorient] = {
    "linear_fc1.weight": Reorient(halves=True, perm=(2, 1, 0)),  # (2, Im, H) -> (H, Im, 2) -> (1, H, 2Im)
    "linear_fc1.bias": Reorient(halves=True, perm=(1, 0)),  # (2, Im) -> (Im, 2) -> (1, 2Im)
    "linear_fc2.weight": Reorient(halves=False, perm=(1, 0)),  # (H, Im) -> (Im, H) -> (1, Im, H)
    "linear_fc2.bias": Reorient(halves=False, perm=(0,)),  # (H,) -> (1, H)
}
"""Suffix after `mlp.experts.local_experts.{k}.` -> its reorientation (gpt-oss only)."""
REORIENTED_BY_FAMILY: dict[str, dict[str, Reorient]] = {"gpt_oss": REORIENTED}


def grouped_shape(r: Reorient, live: tuple[int, ...]) -> tuple[int, ...]:
    """The live shape viewed with Megatron's gate/up halves as a dim of their own."""
    return (2, live[0] // 2, *live[1:]) if r.halves else live


def permuted_shape(r: Reorient, live: tuple[int, ...]) -> tuple[int, ...]:
    grouped = grouped_shape(r, live)
    return tuple(grouped[i] for i in r.perm)


def sent_shape(r: Reorient, live: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the local tensor the layout declares for a live parameter of shape `live`."""
    p = permuted_shape(r, live)
    return (1, *p[:-2], p[-2] * p[-1]) if r.halves else (1, *p)


def check(te: bool, layout: str, model_type: str, spec: ParallelSpec) -> None:
    """The local spec's rules hold gpt-oss at etp=1 (Megatron-Core's own limit); the TE spec's
    are not written."""
    require(not te, layout, model_type, TE_REFUSAL)
    require(spec.etp == 1, layout, "mlp.experts", f"etp={spec.etp}: {ETP_REFUSAL}")


def experts(
    out: ShardBuilder, prefix: str, fused: tuple[TensorMeta, ...], spec: ParallelSpec, coord: RankCoord
) -> None:
    """The rank's local experts of one layer (experts ep_rank-th of ep), each whole (etp=1)."""
    e0, e1 = part(fused[0].shape[0], spec.ep, coord.ep_rank)
    for k, e in enumerate(range(e0, e1)):
        for suffix, t in zip(LOCAL_OF.values(), fused, strict=True):
            canon: Box = ((e, e + 1), *((0, s) for s in t.shape[1:]))
            local, shape = f"{prefix}{EXPERT_PREFIX}{k}.{suffix}", box_shape(canon)
            out.local(local, shape, t.dtype)
            out.piece(t.name, canon, local, full_box(shape))
