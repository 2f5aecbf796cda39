"""Status derivation (pure): (spec, pod, status.runtime, prior status) -> the operator's status + events.

The operator owns every status field except `status.runtime`, and writes them in one merge patch
per reconcile. Deriving twice from the same inputs gives the same status (conditions keep their
lastTransitionTime unless their status flips), so reacting to its own writes is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import ValidationError

from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.public import public_message
from sync_runtime.schema.report import SyncReport, SyncResult
from sync_runtime.schema.status import (
    ConditionType,
    FailureSummary,
    LastSync,
    Phase,
    ReplicaStatus,
    RuntimePhase,
    RuntimeStatus,
    WeightSyncStatus,
)
from weightsync_operator.conditions import ConditionUpdate, merge_conditions, safe_reason
from weightsync_operator.pod import PodPhase, PodState, runtime_pod_name
from weightsync_operator.replicas import out_of_serving, replica_statuses, serving_column
from weightsync_operator.retry import PodAction, PodDecision

T, F = "True", "False"


@dataclass(frozen=True, slots=True)
class SyncEvent:
    """A Kubernetes Event to post (and, for finished syncs, a metrics observation)."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    key: str
    """Identifies the occurrence, so concurrent reconciles post it once."""
    result: str | None = None
    seconds: float = 0.0
    moved_bytes: int = 0


def parse_report(runtime: RuntimeStatus | None) -> SyncReport | None:
    """The runtime's last report, or None when absent or unreadable (never fails the reconcile)."""
    if runtime is None or not runtime.last_report:
        return None
    try:
        return SyncReport.model_validate(runtime.last_report)
    except ValidationError:
        return None


def summarize(report: SyncReport) -> LastSync:
    failure = None
    if report.failure is not None:
        f = report.failure
        # The CR status shape (crd.FailureSummary): what the status schema declares of the failure.
        failure = FailureSummary(
            reason=f.reason, message=public_message(f.message), rank=f.rank, step=f.step and f.step.value
        )
    return LastSync(
        version=report.version,
        result=report.result.value,
        planned_bytes=report.planned_bytes,
        moved_bytes=report.moved_bytes,
        seconds=report.seconds,
        throughput_bytes_per_second=report.throughput_bytes_per_second,
        stages=report.stages.model_dump(),
        started_at=report.started_at,
        finished_at=report.finished_at,
        plan_cached=report.plan_cached,
        failure=failure,
        encoding=report.encoding,
        wire_bytes=report.wire_bytes,
        full_bytes=report.full_bytes,
        changed_fraction=report.changed_fraction,
    )


def live_runtime(runtime: RuntimeStatus | None, pod: PodState) -> RuntimeStatus | None:
    """status.runtime if the pod now running wrote it; a replaced pod's last words are ignored."""
    if runtime is None or pod.phase is not PodPhase.RUNNING:
        return None
    if runtime.pod_uid is not None and runtime.pod_uid != pod.uid:
        return None
    return runtime


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _failure_text(last: LastSync) -> str:
    f = last.failure
    if f is None:
        return f"sync of version {last.version} failed"
    where = ", ".join(x for x in (f.rank is not None and f"rank {f.rank}", f.step and f"step {f.step}") if x)
    return (
        f"sync of version {last.version} failed: {f.reason}"
        + (f" ({where})" if where else "")
        + (f": {f.message}" if f.message else "")
    )


@dataclass(frozen=True, slots=True)
class _Facts:
    """Everything the phase and condition rules look at, computed once."""

    desired: str | None
    synced: str | None
    last: LastSync | None
    live: RuntimeStatus | None
    pod: PodState
    decision: PodDecision
    spec_error: str | None
    pod_name: str
    pod_error: str | None = None
    spec_reason: str = "InvalidSpec"
    """Why the spec cannot be used: InvalidSpec, or RuntimeOverrideRefused (the installer's allowlist)."""
    replicas: tuple[ReplicaStatus, ...] = ()

    @property
    def sync_failed(self) -> bool:
        return self.last is not None and self.last.version == self.desired and self.last.result == "Failed"

    @property
    def syncing(self) -> bool:
        return self.live is not None and self.live.phase is RuntimePhase.SYNCING

    @property
    def runtime_failed(self) -> bool:
        return self.live is not None and self.live.phase is RuntimePhase.FAILED


def _phase(x: _Facts) -> Phase:
    if x.spec_error or x.decision.give_up or x.runtime_failed:
        return Phase.FAILED
    if x.syncing:
        return Phase.SYNCING
    if x.desired is not None and x.synced == x.desired:
        return Phase.SYNCED
    if x.sync_failed:
        return Phase.FAILED
    if x.live is not None and x.live.phase is RuntimePhase.IDLE:
        return Phase.SYNCING
    if x.pod.phase is PodPhase.RUNNING:
        return Phase.CONNECTING
    return Phase.PENDING


def _runtime_ready(x: _Facts) -> ConditionUpdate:
    c, pod = ConditionType.RUNTIME_READY, x.pod
    if x.spec_error:
        return ConditionUpdate(c, F, x.spec_reason, x.spec_error)
    if x.decision.give_up:
        return ConditionUpdate(c, F, "RetryLimitExceeded", x.decision.restarts.last_failure_message or "")
    if x.pod_error:
        return ConditionUpdate(c, F, "PodCreateFailed", x.pod_error)
    if x.decision.action in (PodAction.CREATE, PodAction.REPLACE) or not pod.exists:
        return ConditionUpdate(c, F, "PodCreating", f"creating runtime pod {x.pod_name}")
    if pod.phase is PodPhase.TERMINATING or x.decision.action is PodAction.DELETE:
        return ConditionUpdate(
            c, F, "PodTerminating", f"runtime pod {pod.name} is being replaced (spec changed)"
        )
    if pod.phase.ended:
        nxt = x.decision.restarts.next_restart_time
        when = f"; restarting at {nxt.isoformat()}" if nxt else ""
        return ConditionUpdate(c, F, "PodFailed", (x.decision.restarts.last_failure_message or "") + when)
    if pod.phase is not PodPhase.RUNNING:
        detail = ": ".join(s for s in (pod.waiting_reason, pod.message) if s)
        return ConditionUpdate(
            c, F, "PodPending", f"runtime pod {pod.name} is {pod.phase.value} {detail}".strip()
        )
    if x.runtime_failed:
        live = x.live
        assert live is not None
        return ConditionUpdate(
            c, F, safe_reason(live.reason, "RuntimeFailed"), live.message or "runtime failed"
        )
    if x.live is None or x.live.phase is RuntimePhase.CONNECTING or x.live.phase is None:
        return ConditionUpdate(
            c, F, "RuntimeConnecting", "runtime pod is running; connecting to the Ray clusters"
        )
    return ConditionUpdate(c, T, "RuntimeConnected", f"runtime pod {pod.name} is connected")


def _syncing(x: _Facts) -> ConditionUpdate:
    c = ConditionType.SYNCING
    if x.syncing:
        p = x.live.progress if x.live else None
        detail = f": {p.step}, {_gb(p.done_bytes)} of {_gb(p.total_bytes)}" if p else ""
        return ConditionUpdate(
            c, T, "InProgress", f"syncing version {x.live.version if x.live else ''}{detail}"
        )
    phase = _phase(x)
    if phase is Phase.SYNCING:
        return ConditionUpdate(
            c, T, "SyncRequested", f"version {x.desired} requested; the runtime is starting it"
        )
    if phase is Phase.SYNCED:
        return ConditionUpdate(c, F, "Idle", f"version {x.desired} is synced")
    if x.sync_failed:
        return ConditionUpdate(c, F, "SyncFailed", _failure_text(x.last) if x.last else "")
    return ConditionUpdate(c, F, "WaitingForRuntime", "the runtime is not ready")


def _synced(x: _Facts) -> ConditionUpdate:
    c = ConditionType.SYNCED
    if x.desired is not None and x.synced == x.desired:
        secs = f" in {x.last.seconds:.2f}s" if x.last and x.last.version == x.desired else ""
        return ConditionUpdate(c, T, "VersionSynced", f"version {x.desired} synced{secs}")
    if x.sync_failed and not x.syncing and x.last is not None:
        reason = safe_reason(x.last.failure.reason if x.last.failure else None, "SyncFailed")
        return ConditionUpdate(c, F, reason, _failure_text(x.last))
    return ConditionUpdate(
        c, F, "SyncPending", f"version {x.desired} not synced yet (synced: {x.synced or 'none'})"
    )


def _degraded(x: _Facts) -> ConditionUpdate:
    c, r = ConditionType.DEGRADED, x.decision.restarts
    if x.spec_error:
        return ConditionUpdate(c, T, x.spec_reason, x.spec_error)
    if x.decision.give_up:
        msg = f"runtime pod failed {r.count} times (retry.limit exhausted): {r.last_failure_message or ''}"
        return ConditionUpdate(c, T, "RetryLimitExceeded", msg)
    if x.pod_error:
        return ConditionUpdate(c, T, "PodCreateFailed", x.pod_error)
    if x.pod.phase.ended:
        return ConditionUpdate(c, T, "RuntimePodFailed", f"failure {r.count}: {r.last_failure_message or ''}")
    if x.pod.stuck:
        return ConditionUpdate(c, T, safe_reason(x.pod.waiting_reason, "PodError"), x.pod.message or "")
    if x.runtime_failed and x.live is not None:
        return ConditionUpdate(c, T, safe_reason(x.live.reason, "RuntimeFailed"), x.live.message or "")
    if x.sync_failed and not x.syncing and x.last is not None:
        # A replica kept out of serving is the more specific (and actionable) fact than the failure:
        # it gives the reason; the message says both (which replica, and what failed, e.g. a rank).
        bad = out_of_serving(x.replicas)
        if bad is not None:
            text = f"{bad[1]}; {_failure_text(x.last)}"
            return ConditionUpdate(c, T, safe_reason(bad[0], "ReplicaOutOfServing"), text)
        return ConditionUpdate(c, T, "SyncFailed", _failure_text(x.last))
    return ConditionUpdate(c, F, "AsExpected", "")


def _events(x: _Facts, report: SyncReport | None, prior: WeightSyncStatus) -> list[SyncEvent]:
    events = []
    live = x.live
    if (
        x.syncing
        and live is not None
        and live.version
        and (
            prior.phase is not Phase.SYNCING
            or prior.progress is None
            or prior.progress.version != live.version
        )
    ):
        events.append(
            SyncEvent(
                "Normal",
                "SyncStarted",
                f"sync of version {live.version} started",
                key=f"start/{live.version}/{live.pod_uid}/{live.heartbeat_time}",
            )
        )
    new, old = x.last, prior.last_sync
    if (
        report is not None
        and new is not None
        and (old is None or (old.version, old.finished_at) != (new.version, new.finished_at))
    ):
        key = f"done/{new.version}/{new.finished_at}"
        if new.result == SyncResult.SUCCEEDED.value:
            msg = (
                f"version {new.version} synced: {_gb(new.moved_bytes)} in {new.seconds:.2f}s "
                f"({new.throughput_bytes_per_second / 1e9:.2f} GB/s)"
            )
            events.append(
                SyncEvent("Normal", "SyncSucceeded", msg, key, "Succeeded", new.seconds, new.moved_bytes)
            )
        else:
            events.append(
                SyncEvent(
                    "Warning", "SyncFailed", _failure_text(new), key, "Failed", new.seconds, new.moved_bytes
                )
            )
    if (
        x.decision.give_up
        and prior.restarts.count <= x.decision.restarts.count
        and prior.phase is not Phase.FAILED
    ):
        events.append(
            SyncEvent(
                "Warning",
                "RetryLimitExceeded",
                f"runtime pod failed {x.decision.restarts.count} times; giving up until the spec changes",
                key=f"giveup/{x.decision.restarts.count}",
            )
        )
    return events


def derive_status(
    spec: WeightSyncSpec | None,
    generation: int | None,
    pod_state: PodState,
    runtime_status: RuntimeStatus | None,
    prior_status: WeightSyncStatus,
    now: datetime,
    *,
    decision: PodDecision,
    spec_error: str | None = None,
    desired_hash: str | None = None,
    ws_name: str = "",
    pod_error: str | None = None,
    spec_reason: str = "InvalidSpec",
) -> tuple[WeightSyncStatus, list[SyncEvent]]:
    """The operator-owned status and the events this change warrants.

    `spec` None (with `spec_error`) means the spec could not be used. `decision` is what the
    reconcile did to the pod this time (a just-created pod counts as being created); `pod_error`
    is the API server's refusal of that pod write.
    """
    now = now.replace(microsecond=0)  # metav1.Time has second precision; keeps equality stable
    report = parse_report(runtime_status)
    last = summarize(report) if report is not None else prior_status.last_sync
    ok = report is not None and report.result is SyncResult.SUCCEEDED
    synced = report.version if ok and report is not None else prior_status.synced_version
    live = live_runtime(runtime_status, pod_state)
    pod_name = pod_state.name or runtime_pod_name(ws_name)
    replicas = replica_statuses(report, prior_status.replicas)
    desired = spec.version if spec else None
    x = _Facts(desired, synced, last, live, pod_state, decision, spec_error, pod_name, pod_error, spec_reason,
               tuple(replicas))  # fmt: skip
    updates = [_runtime_ready(x), _syncing(x), _synced(x), _degraded(x)]
    progress = live.progress if x.syncing and live is not None else None
    creating = decision.action in (PodAction.CREATE, PodAction.REPLACE)
    status = WeightSyncStatus(
        phase=_phase(x),
        observed_generation=generation,
        conditions=merge_conditions(prior_status.conditions, updates, now, generation),
        synced_version=synced,
        last_sync=last,
        progress=progress,
        runtime_pod=pod_name if pod_state.exists or creating else None,
        destinations=",".join(d.name for d in spec.destinations) if spec else prior_status.destinations,
        topology_hash=desired_hash,
        replicas=replicas,
        serving=serving_column(report, prior_status.serving),
        restarts=decision.restarts,
        runtime=runtime_status,
    )
    return status, _events(x, report, prior_status)


def status_patch(status: WeightSyncStatus, current: dict[str, Any] | None) -> dict[str, Any] | None:
    """The merge patch that makes the stored status equal `status` (runtime excluded); None if equal.

    Absent fields are sent as null so the merge patch removes them (e.g. progress after a sync).
    Inside list items (a merge patch replaces a list whole) nulls are left out instead: the API
    server prunes them, and kopf would report every such patch as inconsistent.
    """
    want = _patch_form(status)
    have = _patch_form(WeightSyncStatus.model_validate(current or {}))
    return None if want == have else want


def _patch_form(status: WeightSyncStatus) -> dict[str, Any]:
    out = status.model_dump(by_alias=True, mode="json", exclude={"runtime"})
    out["replicas"] = [{k: v for k, v in r.items() if v is not None} for r in out["replicas"]]
    return out
