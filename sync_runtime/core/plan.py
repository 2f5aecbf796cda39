"""The plan: the planner's output and the transfer engine's input (DESIGN 5).

Ranks are global ranks of the sync's single process group: source ranks first (in the order of
`SyncPlan.ranks`), then destination ranks. Within a round every rank sends and receives each of
its buckets once; rounds run in order. A bucket is one flat message between one (src, dst) pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sync_runtime.core.layouts.base import Box
from sync_runtime.core.topology import RankCoord


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy `src_name[src_box]` on `src_rank` to `dst_name[dst_box]` on `dst_rank` (same element count)."""

    src_rank: int
    dst_rank: int
    tensor: str
    """Canonical tensor the bytes belong to."""
    src_name: str
    src_box: Box
    dst_name: str
    dst_box: Box
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """Transfers between one pair packed into one flat message, in this order."""

    src_rank: int
    dst_rank: int
    transfers: tuple[Transfer, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Round:
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank does: per round, the buckets it sends and the buckets it receives."""

    rank: int
    digest: str
    sends: tuple[tuple[Bucket, ...], ...]
    recvs: tuple[tuple[Bucket, ...], ...]


@dataclass(frozen=True, slots=True)
class SyncPlan:
    ranks: tuple[RankCoord, ...]
    """Coordinate of every global rank of the sync process group (sources first)."""
    rounds: tuple[Round, ...]
    digest: str
    """Stable hash of everything that defines the plan; every participant checks it."""
    relay: bool = False
    """True when destination replicas forward to each other (some buckets then leave a destination)."""
    stats: dict = field(default_factory=dict, compare=False, hash=False)

    def for_rank(self, rank: int) -> RankPlan:
        sends = tuple(tuple(b for b in r.buckets if b.src_rank == rank) for r in self.rounds)
        recvs = tuple(tuple(b for b in r.buckets if b.dst_rank == rank) for r in self.rounds)
        return RankPlan(rank=rank, digest=self.digest, sends=sends, recvs=recvs)
