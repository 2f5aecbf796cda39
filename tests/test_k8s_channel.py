"""The runtime -> operator channel: patch bodies, throttling, and the desired-spec watch (fake API)."""

from __future__ import annotations

import copy
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from sync_runtime.kube import status as k8s
from sync_runtime.schema.report import ProgressEvent, SyncFailure, SyncReport, SyncResult, SyncStep
from sync_runtime.schema.status import RuntimePhase, RuntimeStatus, WeightSyncStatus

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def report(ok: bool = True, naive: bool = False) -> SyncReport:
    start = datetime(2025, 1, 1, 0, 0, 0) if naive else T0
    return SyncReport(
        version="v3",
        started_at=start,
        finished_at=start + timedelta(seconds=2),
        result=SyncResult.SUCCEEDED if ok else SyncResult.FAILED,
        failure=None
        if ok
        else SyncFailure(reason="TransferTimeout", message="m", rank=1, step=SyncStep.TRANSFER),
        moved_bytes=10,
        seconds=2.0,
    )


def test_progress_patch_touches_only_status_runtime() -> None:
    event = ProgressEvent(
        version="v3", step=SyncStep.TRANSFER, done_bytes=5, total_bytes=10, round=1, rounds=4
    )
    body = k8s.progress_patch(event, T0, "pod", "uid")
    assert list(body) == ["status"] and list(body["status"]) == ["runtime"]
    rt = body["status"]["runtime"]
    assert (
        rt["phase"] == "Syncing"
        and rt["version"] == "v3"
        and rt["podUid"] == "uid"
        and rt["podName"] == "pod"
    )
    assert rt["progress"] == {
        "version": "v3",
        "step": "transfer",
        "doneBytes": 5,
        "totalBytes": 10,
        "round": 1,
        "rounds": 4,
    }
    assert rt["heartbeatTime"] == "2025-01-01T00:00:00Z" and rt["reason"] is None
    assert RuntimeStatus.model_validate(rt).phase is RuntimePhase.SYNCING


def test_finished_patch_carries_full_report_and_clears_progress() -> None:
    rt = k8s.finished_patch(report(ok=False), T0)["status"]["runtime"]
    assert rt["phase"] == "Idle" and rt["progress"] is None and "podUid" not in rt
    last = rt["lastReport"]
    assert last["result"] == "Failed" and last["failure"]["reason"] == "TransferTimeout"
    assert last["movedBytes"] == 10 and last["throughputBytesPerSecond"] == 0.0 and "ranks" in last
    ok = k8s.finished_patch(report(), T0)["status"]["runtime"]["lastReport"]
    assert ok["failure"] is None  # null: the merge patch removes the previous failure
    assert SyncReport.model_validate(last).failure.rank == 1


def test_naive_report_times_are_sent_as_utc() -> None:
    last = k8s.report_json(report(naive=True))
    assert last["startedAt"] == "2025-01-01T00:00:00Z" and last["finishedAt"] == "2025-01-01T00:00:02Z"


def test_phase_patch() -> None:
    rt = k8s.phase_patch(RuntimePhase.FAILED, T0, reason="RayClusterUnreachable", message="m")["status"][
        "runtime"
    ]
    assert (rt["phase"], rt["reason"], rt["message"], rt["progress"]) == (
        "Failed",
        "RayClusterUnreachable",
        "m",
        None,
    )
    assert "version" not in rt
    rt = k8s.phase_patch(RuntimePhase.SYNCING, T0, version="v9")["status"]["runtime"]
    assert rt["version"] == "v9" and "progress" not in rt


class FakeApi:
    def __init__(self, fail: int = 0) -> None:
        self.patches: list[tuple[tuple, dict]] = []
        self.fail = fail

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> None:
        if self.fail:
            self.fail -= 1
            raise ApiException(status=500)
        self.patches.append((args, kwargs))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_reporter_throttles_progress_to_two_per_second() -> None:
    api, clock = FakeApi(), Clock()
    scheduled: list[float] = []
    r = k8s.KubernetesReporter(
        "ns",
        "ws",
        api=api,
        clock=clock,
        now=lambda: T0,
        environ={"POD_NAME": "p", "POD_UID": "u"},
        schedule=lambda delay, callback: scheduled.append(delay) or object(),  # never fires
    )
    for i in range(10):  # 10 events within 0.45 s: one patch
        clock.t = 100.0 + i * 0.05
        r.progress(ProgressEvent(version="v", step=SyncStep.TRANSFER, done_bytes=i))
    assert len(api.patches) == 1
    assert scheduled == [pytest.approx(0.45)]  # one delivery timer for the held-back events
    clock.t = 100.6
    r.progress(ProgressEvent(version="v", step=SyncStep.TRANSFER, done_bytes=99))
    assert len(api.patches) == 2
    args, kwargs = api.patches[-1]
    assert args[:5] == ("weightsync.io", "v1alpha1", "ns", "weightsyncs", "ws")
    assert kwargs["_content_type"] == "application/merge-patch+json"
    assert args[5]["status"]["runtime"]["progress"]["doneBytes"] == 99
    assert args[5]["status"]["runtime"]["podUid"] == "u"
    clock.t = 100.7
    r.progress(ProgressEvent(version="v", step=SyncStep.VERIFY, done_bytes=100))
    assert len(api.patches) == 2
    r.flush()  # the coalesced event goes out on flush
    assert api.patches[-1][0][5]["status"]["runtime"]["progress"]["step"] == "verify"
    r.finished(report())
    assert api.patches[-1][0][5]["status"]["runtime"]["phase"] == "Idle"
    r.flush()
    assert len(api.patches) == 4  # nothing pending after finished()


def test_reporter_delivers_a_held_back_event_without_another_call() -> None:
    """A long step (a stalled transfer) must still show up in status.runtime.progress."""
    api = FakeApi()
    r = k8s.KubernetesReporter("ns", "ws", api=api, min_interval=0.2, environ={})
    r.progress(ProgressEvent(version="v", step=SyncStep.PLAN))
    r.progress(ProgressEvent(version="v", step=SyncStep.TRANSFER, done_bytes=1))
    assert [p[0][5]["status"]["runtime"]["progress"]["step"] for p in api.patches] == ["plan"]
    deadline = time.monotonic() + 5
    while len(api.patches) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert api.patches[-1][0][5]["status"]["runtime"]["progress"]["step"] == "transfer"
    r.progress(ProgressEvent(version="v", step=SyncStep.VERIFY))
    r.finished(report())  # supersedes the held-back event: no progress patch after it
    time.sleep(0.4)
    assert api.patches[-1][0][5]["status"]["runtime"]["phase"] == "Idle"


def test_reporter_never_raises_and_retries_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s.time, "sleep", lambda s: None)
    api = FakeApi(fail=2)
    r = k8s.KubernetesReporter("ns", "ws", api=api, environ={})
    r.finished(report())
    assert len(api.patches) == 1
    api.fail = 5
    r.set_phase(RuntimePhase.CONNECTING)  # one attempt, logged, no exception
    assert len(api.patches) == 1


def obj(generation: int, version: str, rv: str = "1") -> dict:
    spec = {
        "version": version,
        "source": {"name": "s", "rayAddress": "a", "actorPrefix": "t-", "layout": "megatron"},
        "destinations": [{"name": "d", "rayAddress": "a", "actorPrefix": "v-", "layout": "vllm"}],
    }
    return {"metadata": {"generation": generation, "resourceVersion": rv}, "spec": spec}


class WatchApi:
    """GET returns successive objects; the watch stream replays scripted event lists."""

    def __init__(self, gets: list, streams: list[list[dict]]) -> None:
        self.gets, self.streams = gets, streams

    def get_namespaced_custom_object(self, *args: Any) -> dict:
        item = self.gets.pop(0)
        if isinstance(item, Exception):
            raise item
        return copy.deepcopy(item)

    def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> None:  # only passed to Watch
        raise AssertionError("called through the fake Watch")


def test_watch_desired_yields_on_generation_changes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    api = WatchApi(
        gets=[obj(1, "v1"), obj(1, "v1", "5"), obj(2, "v2", "7"), ApiException(status=404)],
        streams=[
            [
                {"type": "MODIFIED", "object": obj(1, "v1", "5")},  # a status write: same generation
                {"type": "MODIFIED", "object": obj(2, "v2", "6")},
            ],
            [],  # watch window ends quietly
            [{"type": "DELETED", "object": obj(2, "v2", "8")}],
        ],
    )
    opened = []

    class FakeWatch:
        def stream(self, fn: Any, *args: Any, **kwargs: Any):
            opened.append(kwargs)
            return iter(api.streams.pop(0))

    monkeypatch.setattr(k8s_watch, "Watch", FakeWatch)
    versions = [s.version for s in k8s.watch_desired("ns", "ws", api=api)]
    assert versions == ["v1", "v2"]
    assert opened[0]["field_selector"] == "metadata.name=ws" and opened[0]["resource_version"] == "1"


def test_watch_desired_ends_when_cr_is_gone() -> None:
    api = WatchApi(gets=[ApiException(status=404)], streams=[])
    assert list(k8s.watch_desired("ns", "ws", api=api)) == []


def test_desired_changed_and_read_status() -> None:
    assert k8s.desired_changed(None, obj(1, "v")) and not k8s.desired_changed(1, obj(1, "v"))

    class Api:
        def get_namespaced_custom_object(self, *args: Any) -> dict:
            return {"status": {"syncedVersion": "v7", "runtime": {"phase": "Idle"}}}

    status = k8s.read_status("ns", "ws", api=Api())
    assert isinstance(status, WeightSyncStatus) and status.synced_version == "v7"


TRACEBACK = """loading plan
Traceback (most recent call last):
  File "/opt/venv/lib/python3.12/site-packages/sync_runtime/runtime/loop.py", line 12, in run
    secret = open("/var/run/secrets/token").read()
  File "/opt/venv/lib/python3.12/site-packages/x.py", line 3, in f
    raise ValueError(f"bad token {secret}")
ValueError: plan digest mismatch"""


def test_a_traceback_never_reaches_status_runtime() -> None:
    """Status carries reason and the exception's last line; the traceback stays in the pod's log."""
    rt = k8s.phase_patch(RuntimePhase.FAILED, T0, reason="PlanRefused", message=TRACEBACK)["status"][
        "runtime"
    ]
    assert rt["message"] == "ValueError: plan digest mismatch (details in the runtime's log)"
    failed = report(ok=False).model_copy(
        update={"failure": SyncFailure(reason="TransferTimeout", message=TRACEBACK, rank=1)}
    )
    msg = k8s.finished_patch(failed, T0)["status"]["runtime"]["lastReport"]["failure"]["message"]
    assert "Traceback" not in msg and 'File "' not in msg and "/var/run/secrets" not in msg
    # Plain messages pass unchanged.
    plain = k8s.phase_patch(RuntimePhase.FAILED, T0, reason="R", message="connection refused")
    assert plain["status"]["runtime"]["message"] == "connection refused"
