"""Whether a discovered side holds the MTP part (DeepSeek-V3's draft layers), from what its
ranks report, never from a declaration: a vLLM engine started with MTP speculative decoding
reports its drafter's tensors (engines/vllm_worker.py), one without reports none.

A rank is asked only where the layout places an MTP tensor on it (the last PP stage); such
ranks must agree, all holding the part or none: an engine whose workers disagree is refused in
one line naming both kinds, before a byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec, RankCoord
from sync_runtime.errors import TopologyMismatchError


@dataclass(frozen=True, slots=True)
class ReportedRank:
    """One rank as discovery found it: a label for messages, its coordinate, its tensor names."""

    label: str
    coord: RankCoord
    names: frozenset[str]


def mtp_local_names(layout: str, spec: ParallelSpec, manifest: Manifest, coord: RankCoord) -> frozenset[str]:
    """The local names under which `layout` places MTP tensors on the rank at `coord` (empty: the
    model has no MTP part, the layout places none, or none on this rank). A local tensor that
    also holds model tensors says nothing of MTP (Megatron's MTP layers use the main embedding
    and output layer: layouts/megatron_mtp.py)."""
    if not manifest.mtp or not getattr(get_layout(layout), "places_mtp", False):
        return frozenset()
    mtp = {t.name for t in manifest.mtp}
    shard = get_layout(layout).shard(manifest.with_mtp(), spec, coord)
    model = {p.local_name for p in shard.pieces if p.tensor not in mtp}
    return frozenset(p.local_name for p in shard.pieces if p.tensor in mtp) - model


def side_holds_mtp(
    deployment: str, layout: str, spec: ParallelSpec, manifest: Manifest, ranks: Sequence[ReportedRank]
) -> bool:
    """True when the ranks that would hold MTP tensors all report them, False when none does;
    TopologyMismatchError when some do and some do not."""
    if not manifest.mtp or not getattr(get_layout(layout), "places_mtp", False):
        return False
    holding: list[str] = []
    lacking: list[str] = []
    for rank in ranks:
        expected = mtp_local_names(layout, spec, manifest, rank.coord)
        if expected:
            (holding if expected & rank.names else lacking).append(rank.label)
    if holding and lacking:
        raise TopologyMismatchError(
            f"deployment {deployment!r}: MTP (draft) tensors reported by {', '.join(holding)} but not "
            f"by {', '.join(lacking)}: every rank of a deployment holds the MTP part or none does"
        )
    return bool(holding)
