"""The runtime's JSON report (design §6) and progress events: the one wire format shared by the
runtime and the operator besides the CRD. Serialised camelCase (`model_dump(by_alias=True)`),
so the operator can copy a summary into the CR's status without renaming.

`SyncFailure` and `SyncStep` are those of `sync_runtime.errors` (one wire type per concept),
re-exported here with the rest of the report.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from sync_runtime.errors import SyncFailure, SyncStep


class WireModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class SyncResult(StrEnum):
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class StageSeconds(WireModel):
    discover: float = 0.0
    plan: float = 0.0
    connect: float = 0.0
    transfer: float = 0.0
    verify: float = 0.0
    commit: float = 0.0


class RankBytes(WireModel):
    rank: int
    role: str
    name: str
    """Participant (Ray actor) name."""
    send_bytes: int
    recv_bytes: int


class RankSummary(WireModel):
    """The per-rank table in brief, of a size that does not grow with the fleet: what the CR's
    status keeps (the full table stays in the report file and the runtime's log)."""

    count: int = 0
    max_send_bytes: int = 0
    mean_send_bytes: float = 0.0
    max_recv_bytes: int = 0
    mean_recv_bytes: float = 0.0
    busiest_sender: str | None = None
    busiest_receiver: str | None = None

    @classmethod
    def of(cls, ranks: list[RankBytes]) -> RankSummary:
        if not ranks:
            return cls()
        sender = max(ranks, key=lambda r: r.send_bytes)
        receiver = max(ranks, key=lambda r: r.recv_bytes)
        return cls(
            count=len(ranks),
            max_send_bytes=sender.send_bytes,
            mean_send_bytes=sum(r.send_bytes for r in ranks) / len(ranks),
            max_recv_bytes=receiver.recv_bytes,
            mean_recv_bytes=sum(r.recv_bytes for r in ranks) / len(ranks),
            busiest_sender=sender.name,
            busiest_receiver=receiver.name,
        )


class ReplicaState(StrEnum):
    SERVING = "Serving"
    """Every rank holds one complete version and the replica serves it."""
    DEGRADED = "Degraded"
    """Its ranks hold different versions (reason MixedVersions): kept out of serving."""
    POISONED = "Poisoned"
    """An in-place sync failed half way: neither version; kept out of serving."""


class ReplicaVersion(WireModel):
    """One destination replica after a sync: which version it serves, if any."""

    deployment: str
    replica: int
    version: str | None = None
    """The one version all its ranks hold; None when they disagree or are poisoned. Defaulted: the
    API server prunes a null inside status.runtime.lastReport, so a stored report lacks the key."""
    state: ReplicaState
    reason: str | None = None
    rank_versions: list[str | None] = []
    """Committed version per rank of the replica (None: the rank did not answer)."""
    pause_seconds: float | None = None
    """Seconds this sync's apply held the replica's generation paused (a vLLM engine's own pause
    to resume), apart from transfer seconds; None where the replica was not paused by this sync
    or its destination does not measure it."""


LISTED_REPLICAS = 32
"""The CR's status lists at most this many replicas (those out of serving first); the report file
and the runtime's log keep them all."""


class ReplicaSummary(WireModel):
    """The replica list in brief, of a size that does not grow with the fleet (the CR's status)."""

    count: int = 0
    serving: int = 0
    max_pause_seconds: float | None = None

    @classmethod
    def of(cls, replicas: list[ReplicaVersion]) -> ReplicaSummary:
        pauses = [r.pause_seconds for r in replicas if r.pause_seconds is not None]
        return cls(
            count=len(replicas),
            serving=sum(r.state is ReplicaState.SERVING for r in replicas),
            max_pause_seconds=max(pauses) if pauses else None,
        )


def listed_replicas(replicas: list[ReplicaVersion], limit: int = LISTED_REPLICAS) -> list[ReplicaVersion]:
    """The replicas the CR's status names, at most `limit`, in (deployment, replica) order: every
    one out of serving (the actionable ones) before any serving one is chosen."""
    by_need = sorted(replicas, key=lambda r: (r.state is ReplicaState.SERVING, r.deployment, r.replica))
    chosen = by_need[:limit]
    return sorted(chosen, key=lambda r: (r.deployment, r.replica))


class SyncReport(WireModel):
    version: str
    started_at: datetime
    finished_at: datetime
    result: SyncResult
    failure: SyncFailure | None = None
    planned_bytes: int = 0
    moved_bytes: int = 0
    seconds: float = 0.0
    throughput_bytes_per_second: float = 0.0
    stages: StageSeconds = StageSeconds()
    ranks: list[RankBytes] = []
    rank_summary: RankSummary | None = None
    """Set where `ranks` is left out (the CR's status): the table in brief."""
    plan_digest: str = ""
    plan_cached: bool = False
    """True when the plan and process group from an earlier sync were reused (warm path)."""
    rounds: int = 0
    transfers: int = 0
    relay: bool = False
    not_synced: list[str] = []
    """What of the checkpoint this sync leaves out, one line each (e.g. DeepSeek-V3's MTP layers)."""
    replicas: list[ReplicaVersion] = []
    """Per destination replica after the commit (or the recovery that preceded a failed sync)."""
    replica_summary: ReplicaSummary | None = None
    """Set where `replicas` is cut to `LISTED_REPLICAS` (the CR's status): the list in brief."""
    recovered: list[str] = []
    """What this sync finished of an earlier, interrupted one (roll forward / back)."""
    encoding: Literal["full", "delta", "mixed"] = "full"
    """How the destination ranks took this sync: all in full, all as deltas, or some of each."""
    wire_bytes: int = 0
    """Payload bytes the ranks sent (full_bytes less what deltas saved)."""
    full_bytes: int = 0
    """Payload bytes of the same sync in full."""
    changed_fraction: float | None = None
    """Of the elements compared against a replica's base, the fraction that changed."""
    delta_retried: bool = False
    """A delta sync failed a checksum (a replica's live bytes were not its version) and was
    redone in full in the same run."""


class ProgressEvent(WireModel):
    version: str
    step: SyncStep
    done_bytes: int = 0
    total_bytes: int = 0
    round: int = 0
    rounds: int = 0


class Reporter(Protocol):
    """Where the coordinator publishes progress and results (stdout, a file, the Kubernetes API)."""

    def progress(self, event: ProgressEvent) -> None: ...

    def finished(self, report: SyncReport) -> None: ...


class NullReporter:
    """A Reporter that drops everything (tests and callers that only want the returned report)."""

    def progress(self, event: ProgressEvent) -> None:
        pass

    def finished(self, report: SyncReport) -> None:
        pass


__all__ = [
    "NullReporter",
    "ProgressEvent",
    "RankBytes",
    "ReplicaState",
    "ReplicaVersion",
    "Reporter",
    "StageSeconds",
    "SyncFailure",
    "SyncReport",
    "SyncResult",
    "SyncStep",
    "WireModel",
]
