"""Typed models of the WeightSync custom resource's status (see crd.py for the spec).

Status is split by writer: `status.runtime` (RuntimeStatus) belongs to the runtime pod, every
other field to the operator. Status is read back from the API server tolerantly: fields a newer
writer added are ignored, not refused.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class StatusModel(BaseModel):
    """Status is read back from the API: tolerate fields a newer writer added."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class Phase(StrEnum):
    PENDING = "Pending"
    CONNECTING = "Connecting"
    SYNCING = "Syncing"
    SYNCED = "Synced"
    FAILED = "Failed"


class RuntimePhase(StrEnum):
    """What the runtime pod says it is doing (status.runtime.phase)."""

    CONNECTING = "Connecting"
    IDLE = "Idle"
    SYNCING = "Syncing"
    FAILED = "Failed"
    """The runtime cannot work at all (e.g. the Ray cluster is unreachable); reason/message say why."""


class ConditionType(StrEnum):
    RUNTIME_READY = "RuntimeReady"
    """The runtime pod runs and is connected to the deployments' Ray clusters."""
    SYNCING = "Syncing"
    """A sync of spec.version is requested or in progress."""
    SYNCED = "Synced"
    """status.syncedVersion == spec.version."""
    DEGRADED = "Degraded"
    """Something needs attention: failed sync, dead runtime, invalid spec, retries exhausted."""


class Condition(StatusModel):
    """metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: datetime
    observed_generation: int | None = None


class SyncProgress(StatusModel):
    """status.progress. Mirrors report.ProgressEvent because status is read tolerantly (unknown
    fields and steps of a newer runtime must not break the operator), the wire event strictly."""

    version: str
    step: str
    done_bytes: int = 0
    total_bytes: int = 0
    round: int = 0
    rounds: int = 0


class FailureSummary(StatusModel):
    """The CR status shape of a SyncFailure: the fields the CRD declares, read back tolerantly."""

    reason: str
    message: str = ""
    rank: int | None = None
    step: str | None = None


class LastSync(StatusModel):
    """Summary of the last finished sync's report (design §6): the part of report.SyncReport the
    CR's status keeps (no per-rank list, which grows with the fleet), read tolerantly."""

    version: str
    result: Literal["Succeeded", "Failed"]
    planned_bytes: int = 0
    moved_bytes: int = 0
    seconds: float = 0.0
    throughput_bytes_per_second: float = 0.0
    stages: dict[str, float] = {}
    started_at: datetime | None = None
    finished_at: datetime | None = None
    plan_cached: bool = False
    failure: FailureSummary | None = None
    encoding: str = "full"
    """full / delta / mixed (report.SyncReport.encoding)."""
    wire_bytes: int = 0
    full_bytes: int = 0
    changed_fraction: float | None = None


class ReplicaStatus(StatusModel):
    """status.replicas[]: report.ReplicaVersion as the CR keeps it, read tolerantly (a newer
    runtime may report states this operator does not know)."""

    deployment: str
    replica: int
    version: str | None = None
    state: str
    reason: str | None = None
    rank_versions: list[str | None] = []
    pause_seconds: float | None = None
    """report.ReplicaVersion.pause_seconds: one number per replica, no per-rank table."""


class RestartStatus(StatusModel):
    """Runtime pod failures counted against spec.retry.limit (reset on spec changes and successes)."""

    count: int = 0
    last_failure_time: datetime | None = None
    last_failed_pod_uid: str | None = None
    last_failure_message: str | None = None
    next_restart_time: datetime | None = None


class RuntimeStatus(StatusModel):
    """status.runtime: written only by the runtime pod, with JSON merge patches on /status."""

    phase: RuntimePhase | None = None
    version: str | None = None
    """The version being synced (Syncing) or last handled."""
    pod_name: str | None = None
    pod_uid: str | None = None
    """Lets the operator ignore what a replaced pod wrote last."""
    reason: str | None = None
    message: str | None = None
    progress: SyncProgress | None = None
    last_report: dict[str, Any] | None = None
    """The full SyncReport (camelCase); parsed by the operator with report.SyncReport."""
    heartbeat_time: datetime | None = None


class WeightSyncStatus(StatusModel):
    phase: Phase | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = []
    synced_version: str | None = None
    last_sync: LastSync | None = None
    progress: SyncProgress | None = None
    runtime_pod: str | None = None
    destinations: str | None = None
    """Destination names, comma-separated: the Destinations printer column."""
    topology_hash: str | None = None
    replicas: list[ReplicaStatus] = []
    """Each destination replica after the last sync that reached its commit (or recovery)."""
    serving: str | None = None
    """"serving/all" replicas: the Serving printer column."""
    restarts: RestartStatus = RestartStatus()
    runtime: RuntimeStatus | None = None

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
