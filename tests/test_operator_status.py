"""Status derivation from pod states and runtime reports; condition transitions; events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from weightsync_operator.conditions import ConditionUpdate, merge_conditions, safe_reason
from weightsync_operator.pod import MISSING, PodPhase, PodState
from weightsync_operator.retry import PodAction, PodDecision
from weightsync_operator.status import derive_status, status_patch

from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.report import SyncFailure, SyncReport, SyncResult, SyncStep
from sync_runtime.schema.status import Phase, RestartStatus, RuntimeStatus, SyncProgress, WeightSyncStatus

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
SPEC = WeightSyncSpec.model_validate(
    {
        "version": "v2",
        "source": {"name": "s", "rayAddress": "a", "actorPrefix": "t-", "layout": "megatron"},
        "destinations": [{"name": "d", "rayAddress": "a", "actorPrefix": "v-", "layout": "vllm"}],
    }
)
RUNNING = PodState(phase=PodPhase.RUNNING, name="ws-runtime", uid="pod-1", topology_hash="h")
NONE = PodDecision(PodAction.NONE, RestartStatus())


def report(version: str = "v2", ok: bool = True, end: datetime = T0) -> dict:
    failure = (
        None
        if ok
        else SyncFailure(reason="ChecksumMismatch", message="tensor x", rank=3, step=SyncStep.VERIFY)
    )
    r = SyncReport(
        version=version,
        started_at=end - timedelta(seconds=4),
        finished_at=end,
        result=SyncResult.SUCCEEDED if ok else SyncResult.FAILED,
        failure=failure,
        planned_bytes=8_000_000_000,
        moved_bytes=8_000_000_000,
        seconds=4.0,
        throughput_bytes_per_second=2e9,
    )
    return r.model_dump(by_alias=True, mode="json")


def runtime(phase: str = "Idle", **kw: object) -> RuntimeStatus:
    return RuntimeStatus.model_validate({"phase": phase, "podUid": "pod-1", **kw})


def derive(
    pod: PodState = RUNNING,
    rt: RuntimeStatus | None = None,
    prior: WeightSyncStatus | None = None,
    now: datetime = T0,
    decision: PodDecision = NONE,
    **kw: object,
):
    return derive_status(
        SPEC, 7, pod, rt, prior or WeightSyncStatus(), now, decision=decision, ws_name="ws", **kw
    )


def conds(status: WeightSyncStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_pending_while_pod_is_created() -> None:
    status, events = derive(MISSING, decision=PodDecision(PodAction.CREATE, RestartStatus()))
    assert (
        status.phase is Phase.PENDING
        and status.runtime_pod == "ws-runtime"
        and status.observed_generation == 7
    )
    assert conds(status) == {
        "RuntimeReady": ("False", "PodCreating"),
        "Syncing": ("False", "WaitingForRuntime"),
        "Synced": ("False", "SyncPending"),
        "Degraded": ("False", "AsExpected"),
    }
    assert events == []


def test_connecting_until_runtime_reports() -> None:
    status, _ = derive(RUNNING, None)
    assert status.phase is Phase.CONNECTING and conds(status)["RuntimeReady"] == (
        "False",
        "RuntimeConnecting",
    )
    status, _ = derive(RUNNING, runtime("Connecting"))
    assert status.phase is Phase.CONNECTING


def test_idle_runtime_with_new_version_means_sync_requested() -> None:
    status, _ = derive(RUNNING, runtime("Idle"))
    assert status.phase is Phase.SYNCING and conds(status)["Syncing"] == ("True", "SyncRequested")
    assert conds(status)["RuntimeReady"] == ("True", "RuntimeConnected")


def test_syncing_copies_progress_and_emits_started_once() -> None:
    progress = {"version": "v2", "step": "transfer", "doneBytes": 4, "totalBytes": 8, "round": 1, "rounds": 2}
    rt = runtime("Syncing", version="v2", progress=progress)
    status, events = derive(RUNNING, rt)
    assert status.phase is Phase.SYNCING and status.progress == SyncProgress.model_validate(progress)
    assert conds(status)["Syncing"] == ("True", "InProgress")
    assert [e.reason for e in events] == ["SyncStarted"]
    again, events = derive(RUNNING, rt, prior=status, now=T0 + timedelta(seconds=3))
    assert events == [] and again == status  # idempotent: re-deriving from our own write changes nothing


def test_success_sets_synced_version_last_sync_and_event() -> None:
    syncing, _ = derive(RUNNING, runtime("Syncing", version="v2"))
    rt = runtime("Idle", version="v2", lastReport=report())
    status, events = derive(RUNNING, rt, prior=syncing, now=T0 + timedelta(seconds=5))
    assert status.phase is Phase.SYNCED and status.synced_version == "v2" and status.progress is None
    assert status.last_sync is not None and status.last_sync.moved_bytes == 8_000_000_000
    assert status.last_sync.seconds == 4.0 and status.last_sync.stages["transfer"] == 0.0
    assert conds(status)["Synced"] == ("True", "VersionSynced") and conds(status)["Syncing"] == (
        "False",
        "Idle",
    )
    (event,) = events
    assert (event.type, event.reason, event.result, event.moved_bytes) == (
        "Normal",
        "SyncSucceeded",
        "Succeeded",
        8_000_000_000,
    )
    _, events = derive(RUNNING, rt, prior=status, now=T0 + timedelta(seconds=9))
    assert events == []  # the same report is not announced twice


def test_failure_keeps_old_synced_version_and_says_why() -> None:
    prior, _ = derive(RUNNING, runtime("Idle", lastReport=report("v1")))
    assert prior.synced_version == "v1" and prior.phase is Phase.SYNCING
    rt = runtime("Idle", version="v2", lastReport=report("v2", ok=False, end=T0 + timedelta(seconds=30)))
    status, events = derive(RUNNING, rt, prior=prior, now=T0 + timedelta(seconds=31))
    assert status.phase is Phase.FAILED and status.synced_version == "v1"
    assert conds(status)["Synced"] == ("False", "ChecksumMismatch")
    assert conds(status)["Degraded"] == ("True", "SyncFailed")
    message = status.condition("Synced").message
    assert "ChecksumMismatch" in message and "rank 3" in message and "step verify" in message
    assert status.last_sync.failure.rank == 3
    assert [(e.type, e.reason) for e in events] == [("Warning", "SyncFailed")]


def test_stale_runtime_status_of_a_replaced_pod_is_ignored() -> None:
    new_pod = PodState(phase=PodPhase.RUNNING, name="ws-runtime", uid="pod-2", topology_hash="h")
    status, events = derive(new_pod, runtime("Syncing", version="v2"))
    assert status.phase is Phase.CONNECTING and events == []
    # ...but its last report still counts: those bytes were synced.
    status, _ = derive(new_pod, runtime("Idle", lastReport=report("v2")))
    assert status.synced_version == "v2" and status.phase is Phase.SYNCED


def test_runtime_failure_is_degraded_with_runtime_reason() -> None:
    rt = runtime("Failed", reason="RayClusterUnreachable", message="ray://x: connection refused")
    status, _ = derive(RUNNING, rt)
    assert status.phase is Phase.FAILED
    assert conds(status)["RuntimeReady"] == ("False", "RayClusterUnreachable")
    assert conds(status)["Degraded"] == ("True", "RayClusterUnreachable")
    rt = runtime("Failed", reason="not a reason!", message="m")
    assert conds(derive(RUNNING, rt)[0])["Degraded"] == ("True", "RuntimeFailed")


def test_pod_failure_and_retry_limit() -> None:
    dead = PodState(phase=PodPhase.FAILED, name="ws-runtime", uid="pod-1", exit_code=137)
    restarts = RestartStatus(
        count=1,
        last_failure_message="runtime pod ws-runtime exited with code 137",
        next_restart_time=T0 + timedelta(seconds=10),
    )
    status, _ = derive(dead, decision=PodDecision(PodAction.NONE, restarts))
    assert status.phase is Phase.PENDING and status.restarts.count == 1
    assert conds(status)["Degraded"] == ("True", "RuntimePodFailed")
    assert "restarting at" in status.condition("RuntimeReady").message
    gave_up = PodDecision(PodAction.NONE, RestartStatus(count=4, last_failure_message="oom"), give_up=True)
    final, events = derive(dead, decision=gave_up, prior=status)
    assert final.phase is Phase.FAILED and conds(final)["Degraded"] == ("True", "RetryLimitExceeded")
    assert [e.reason for e in events] == ["RetryLimitExceeded"]
    _, events = derive(dead, decision=gave_up, prior=final)
    assert events == []


def test_stuck_pod_reports_kubelet_reason() -> None:
    stuck = PodState(
        phase=PodPhase.PENDING,
        name="ws-runtime",
        uid="pod-1",
        waiting_reason="ImagePullBackOff",
        message="back-off pulling image",
    )
    status, _ = derive(stuck)
    assert conds(status)["Degraded"] == ("True", "ImagePullBackOff")
    assert conds(status)["RuntimeReady"] == ("False", "PodPending")


def test_invalid_spec() -> None:
    status, _ = derive_status(
        None,
        2,
        MISSING,
        None,
        WeightSyncStatus(),
        T0,
        decision=NONE,
        spec_error="spec.transport: bucketMb must be at most stagingBudgetMb/2",
    )
    assert status.phase is Phase.FAILED and conds(status)["Degraded"] == ("True", "InvalidSpec")


def test_last_transition_time_moves_only_on_flip() -> None:
    first, _ = derive(RUNNING, runtime("Idle"), now=T0)
    later, _ = derive(RUNNING, runtime("Idle", message="x"), prior=first, now=T0 + timedelta(minutes=5))
    assert (
        first.condition("RuntimeReady").last_transition_time
        == later.condition("RuntimeReady").last_transition_time
    )
    flipped, _ = derive(
        RUNNING, runtime("Idle", lastReport=report()), prior=later, now=T0 + timedelta(minutes=9)
    )
    synced = flipped.condition("Synced")
    assert synced.status == "True" and synced.last_transition_time == T0 + timedelta(minutes=9)
    assert flipped.condition("RuntimeReady").last_transition_time == T0


def test_merge_conditions_reason_change_without_flip_keeps_time() -> None:
    prior = merge_conditions([], [ConditionUpdate("Synced", "False", "SyncPending")], T0, 1)
    now = T0 + timedelta(hours=1)
    out = merge_conditions(prior, [ConditionUpdate("Synced", "False", "ChecksumMismatch", "m")], now, 2)
    assert (
        out[0].reason == "ChecksumMismatch"
        and out[0].last_transition_time == T0
        and out[0].observed_generation == 2
    )
    out = merge_conditions(out, [ConditionUpdate("Synced", "True", "VersionSynced")], now, 2)
    assert out[0].last_transition_time == now
    assert safe_reason("Bad reason", "X") == "X" and safe_reason("Good_Reason", "X") == "Good_Reason"


def test_status_patch_is_none_when_nothing_changed_and_nulls_removed_fields() -> None:
    progress = {"version": "v2", "step": "plan", "doneBytes": 0, "totalBytes": 8, "round": 0, "rounds": 1}
    syncing, _ = derive(RUNNING, runtime("Syncing", version="v2", progress=progress))
    stored = syncing.model_dump(by_alias=True, mode="json", exclude={"runtime"})
    stored["runtime"] = {"phase": "Syncing"}
    assert status_patch(syncing, stored) is None
    done, _ = derive(RUNNING, runtime("Idle", lastReport=report()), prior=syncing)
    patch = status_patch(done, stored)
    assert patch is not None and patch["progress"] is None and "runtime" not in patch
    assert patch["syncedVersion"] == "v2" and patch["conditions"][0]["lastTransitionTime"].endswith("Z")


def test_status_patch_leaves_nulls_out_of_replica_items() -> None:
    """A merge patch replaces status.replicas whole; nulls inside its items would be pruned by the
    API server (and reported by kopf as an inconsistent patch on every reconcile)."""
    rep = _with_replicas("v2", False, (0, "v2", "Serving", ["v2"]), (1, None, "Degraded", ["v1", None]))
    status, _ = derive(RUNNING, runtime("Idle", lastReport=rep))
    patch = status_patch(status, None)
    assert patch is not None and patch["replicas"][0] == {
        "deployment": "d", "replica": 0, "version": "v2", "state": "Serving", "rankVersions": ["v2"]
    }  # fmt: skip
    assert "version" not in patch["replicas"][1] and patch["replicas"][1]["rankVersions"] == ["v1", None]
    stored = {**patch, "runtime": {"phase": "Idle"}}
    assert status_patch(status, stored) is None  # what the server keeps reads back as equal


def test_no_traceback_reaches_conditions_or_restart_messages() -> None:
    """Pod termination messages are the log tail (FallbackToLogsOnError): often a traceback."""
    from sync_runtime.schema.public import public_message

    tb = "Traceback (most recent call last):\n  File \"/x.py\", line 1, in <module>\n    f()\nKeyError: 'k'"
    (c,) = merge_conditions([], [ConditionUpdate("Degraded", "True", "PodFailed", tb)], T0, 1)
    assert c.message == "KeyError: 'k' (details in the runtime's log)"
    only_frames = 'Traceback (most recent call last):\n  File "/x.py", line 1, in <module>'
    assert public_message(only_frames) == "failed (details in the runtime's log)"
    assert public_message("x" * 10_000) == "x" * 4096


def _with_replicas(version: str, ok: bool, *replicas: tuple[int, str | None, str, list]) -> dict:
    out = report(version, ok=ok)
    out["replicas"] = [
        {"deployment": "d", "replica": i, "version": v, "state": state, "rankVersions": ranks,
         "reason": None if state == "Serving" else "MixedVersions"}
        for i, v, state, ranks in replicas
    ]  # fmt: skip
    return out


def test_a_report_whose_nulls_the_api_server_pruned_still_names_the_mixed_replica() -> None:
    """The runtime writes `version: null` for a replica whose ranks disagree; the API server drops
    nulls inside status.runtime.lastReport, so the stored report has no `version` key there. Read
    strictly, that report was discarded and Degraded never said MixedVersions (seen in e2e)."""
    mixed = _with_replicas(
        "v2", False, (0, "v2", "Serving", ["v2", "v2"]), (1, None, "Degraded", ["v1", "v2"])
    )
    for r in mixed["replicas"]:
        for key in [k for k, v in r.items() if v is None]:
            del r[key]
    assert "version" not in mixed["replicas"][1]
    status, _ = derive(rt=runtime(lastReport=mixed))
    assert conds(status)["Degraded"] == ("True", "MixedVersions") and status.serving == "1/2"
    assert status.last_sync is not None and status.last_sync.version == "v2"


def test_a_mixed_replica_is_named_in_status_and_degraded_until_repaired() -> None:
    serving, mixed_replica = (0, "v2", "Serving", ["v2", "v2"]), (1, None, "Degraded", ["v1", "v2"])
    mixed = _with_replicas("v2", False, serving, mixed_replica)
    status, _ = derive(rt=runtime(lastReport=mixed))
    assert conds(status)["Degraded"] == ("True", "MixedVersions")
    degraded = status.condition("Degraded")
    assert degraded is not None and "d replica 1 is Degraded (ranks on v1, v2)" in degraded.message
    assert "sync of version v2 failed" in degraded.message  # and what failed, after the replica
    assert status.serving == "1/2"
    got = [(r.replica, r.version, r.state) for r in status.replicas]
    assert got == [(0, "v2", "Serving"), (1, None, "Degraded")]
    assert status.replicas[1].rank_versions == ["v1", "v2"]
    # A later failure that never reached the commit (no replicas in its report) keeps what is known.
    early = report("v2", ok=False, end=T0 + timedelta(minutes=1))
    status, _ = derive(rt=runtime(lastReport=early), prior=status)
    assert status.serving == "1/2" and conds(status)["Degraded"] == ("True", "MixedVersions")
    # The repairing sync: every replica serves v2, Degraded clears.
    good = _with_replicas("v2", True, (0, "v2", "Serving", ["v2", "v2"]), (1, "v2", "Serving", ["v2", "v2"]))
    status, _ = derive(rt=runtime(lastReport=good), prior=status)
    assert conds(status)["Degraded"] == ("False", "AsExpected") and status.serving == "2/2"
    assert status_patch(status, None)["replicas"][1] == {
        "deployment": "d", "replica": 1, "version": "v2", "state": "Serving", "rankVersions": ["v2", "v2"],
    }  # fmt: skip


def test_a_failed_sync_with_every_replica_serving_stays_sync_failed() -> None:
    ok = _with_replicas("v2", False, (0, "v1", "Serving", ["v1"]))
    status, _ = derive(rt=runtime(lastReport=ok))
    assert conds(status)["Degraded"] == ("True", "SyncFailed") and status.serving == "1/1"
