"""Inputs of the planner: one side of a sync and the planner's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sync_runtime.core.cost import LinkCost
from sync_runtime.core.topology import ParallelSpec, RankCoord
from sync_runtime.errors import PlanError

MiB = 1 << 20

RelayMode = Literal["off", "auto", "on"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Budgets and preferences of the planner. Part of the plan digest."""

    bucket_bytes: int = 64 * MiB
    """Largest bucket (one flat message between a pair); larger transfers are split by rows."""
    staging_budget_bytes: int = 512 * MiB
    """Staging memory per rank. A round moves at most half of it per rank and direction,
    so the next round's buckets can be packed while this round's are in flight."""
    max_fan_in: int = 4
    """Most distinct senders one rank receives from in one round."""
    relay: RelayMode = "off"
    """Destination replicas forwarding to each other: never, when the cost model says it is
    faster, or always (where a same-shaped earlier replica exists)."""
    gpus_per_node: int = 8
    """Only used by callers that enumerate ranks; placement comes from `RankCoord.node`."""
    cost: LinkCost = field(default_factory=LinkCost)
    """Link model used to predict round times and to decide `relay="auto"`."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise PlanError(f"bucket_bytes={self.bucket_bytes}: must be >= 1")
        if self.staging_budget_bytes < 2:
            raise PlanError(f"staging_budget_bytes={self.staging_budget_bytes}: must be >= 2")
        if self.max_fan_in < 1:
            raise PlanError(f"max_fan_in={self.max_fan_in}: must be >= 1")
        if self.relay not in ("off", "auto", "on"):
            raise PlanError(f"relay={self.relay!r}: must be one of off, auto, on")
        if self.gpus_per_node < 1:
            raise PlanError(f"gpus_per_node={self.gpus_per_node}: must be >= 1")

    @property
    def round_bytes(self) -> int:
        """Per-rank, per-direction byte cap of one round (half the staging budget)."""
        return self.staging_budget_bytes // 2

    @property
    def effective_bucket_bytes(self) -> int:
        """Bucket size actually used: a bucket must fit in one round's cap."""
        return min(self.bucket_bytes, self.round_bytes)


@dataclass(frozen=True)
class SideSpec:
    """One side of a sync: its layout, declared parallelism and the coordinates of its ranks,
    in the order they become global ranks."""

    layout: str
    spec: ParallelSpec
    coords: tuple[RankCoord, ...]
    mtp: bool = False
    """A destination that serves MTP (vLLM with MTP speculative decoding) and is sent the
    manifest's MTP part; False (the default): it is not sent it, and the plan says so. A
    destination states it: nothing can tell from a spec whether an engine runs a drafter."""
