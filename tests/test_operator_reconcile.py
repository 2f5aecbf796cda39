"""One reconcile end to end with a fake pod API; the kopf wiring; metrics."""

from __future__ import annotations

import copy
import threading
from datetime import UTC, datetime, timedelta

import kopf
import pytest
import weightsync_operator.handlers as handlers
from prometheus_client import generate_latest
from weightsync_operator.config import OperatorConfig
from weightsync_operator.metrics import Metrics
from weightsync_operator.pod import MISSING, PodPhase, PodState, observe_pod, topology_hash
from weightsync_operator.reconcile import reconcile

from sync_runtime.schema.crd import WeightSyncSpec

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
AUTH = {"name": "ray-token"}
SPEC = {
    "version": "v1",
    "source": {
        "name": "s",
        "rayAddress": "a",
        "actorPrefix": "t-",
        "layout": "megatron",
        "authSecretRef": AUTH,
    },
    "destinations": [
        {"name": "d", "rayAddress": "a", "actorPrefix": "v-", "layout": "vllm", "authSecretRef": AUTH}
    ],
    "retry": {"limit": 1, "backoffSeconds": 5, "maxBackoffSeconds": 5},
}


class FakePods:
    def __init__(self) -> None:
        self.created: list[dict] = []
        self.deleted: list[tuple[str, str | None]] = []

    def create_pod(self, namespace: str, body: dict) -> None:
        self.created.append(body)

    def delete_pod(self, namespace: str, name: str, uid: str | None) -> None:
        self.deleted.append((name, uid))


def body(spec: dict | None = None, status: dict | None = None, generation: int = 1) -> dict:
    return {
        "metadata": {"name": "ws", "namespace": "ns", "uid": "cr-uid", "generation": generation},
        "spec": spec or copy.deepcopy(SPEC),
        "status": status or {},
    }


def pod_for(spec: dict, phase: PodPhase = PodPhase.RUNNING, uid: str = "p1") -> PodState:
    return PodState(
        phase=phase,
        name="ws-runtime",
        uid=uid,
        topology_hash=topology_hash(WeightSyncSpec.model_validate(spec)),
        finished_at=T0,
    )


def test_first_reconcile_creates_the_pod_and_writes_status() -> None:
    api = FakePods()
    result = reconcile(body(), MISSING, api, OperatorConfig(), T0)
    (pod,) = api.created
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "cr-uid" and api.deleted == []
    assert result.status_patch is not None and result.status_patch["phase"] == "Pending"
    assert (
        result.status_patch["runtimePod"] == "ws-runtime" and result.status_patch["observedGeneration"] == 1
    )


def test_version_only_change_keeps_the_pod() -> None:
    api = FakePods()
    changed = {**copy.deepcopy(SPEC), "version": "v2"}
    reconcile(body(changed, generation=2), pod_for(SPEC), api, OperatorConfig(), T0)
    assert api.created == [] and api.deleted == []


def test_topology_change_deletes_with_uid_precondition_then_recreates() -> None:
    api = FakePods()
    changed = {**copy.deepcopy(SPEC), "transport": {"bucketMb": 16}}
    result = reconcile(body(changed, generation=2), pod_for(SPEC), api, OperatorConfig(), T0)
    assert api.deleted == [("ws-runtime", "p1")] and api.created == []
    assert result.status_patch["conditions"][0]["reason"] == "PodTerminating"
    reconcile(body(changed, generation=2), MISSING, api, OperatorConfig(), T0)
    assert len(api.created) == 1


def test_dead_pod_replaced_after_backoff_then_given_up() -> None:
    api = FakePods()
    dead = pod_for(SPEC, PodPhase.FAILED, "p1")
    first = reconcile(body(), dead, api, OperatorConfig(), T0 + timedelta(seconds=1))
    assert api.created == [] and first.status_patch["restarts"]["count"] == 1
    status = {**first.status_patch}
    second = reconcile(body(status=status), dead, api, OperatorConfig(), T0 + timedelta(seconds=6))
    assert api.deleted == [("ws-runtime", "p1")] and len(api.created) == 1
    status = {**second.status_patch}
    dead2 = pod_for(SPEC, PodPhase.FAILED, "p2")
    third = reconcile(body(status=status), dead2, api, OperatorConfig(), T0 + timedelta(hours=1))
    assert third.status_patch["phase"] == "Failed" and len(api.created) == 1
    assert [e.reason for e in third.events] == ["RetryLimitExceeded"]


def test_reconcile_is_a_fixed_point() -> None:
    api = FakePods()
    first = reconcile(body(), pod_for(SPEC), api, OperatorConfig(), T0)
    again = reconcile(
        body(status=first.status_patch), pod_for(SPEC), api, OperatorConfig(), T0 + timedelta(1)
    )
    assert first.status_patch is not None and again.status_patch is None


def test_invalid_spec_creates_nothing() -> None:
    api = FakePods()
    bad = {**copy.deepcopy(SPEC), "transport": {"bucketMb": 400, "stagingBudgetMb": 512}}
    result = reconcile(body(bad), MISSING, api, OperatorConfig(), T0)
    assert api.created == [] and result.status_patch["phase"] == "Failed"
    degraded = next(c for c in result.status_patch["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "stagingBudgetMb/2" in degraded["message"]


def test_refused_pod_write_becomes_a_condition() -> None:
    class Refusing(FakePods):
        def create_pod(self, namespace: str, body: dict) -> None:
            raise RuntimeError("error looking up service account ns/weightsync-runtime: not found")

    result = reconcile(body(), MISSING, Refusing(), OperatorConfig(), T0)
    conditions = {c["type"]: c for c in result.status_patch["conditions"]}
    assert (
        conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "PodCreateFailed"
    )
    assert "service account" in conditions["Degraded"]["message"]
    assert conditions["RuntimeReady"]["reason"] == "PodCreateFailed"


def test_metrics_exposition() -> None:
    m = Metrics()
    m.observe_sync("Succeeded", 3.5, 1000)
    m.observe_sync("Failed", 1.0, 10)
    text = generate_latest(m.registry).decode()
    assert 'weightsync_syncs_total{result="Succeeded"} 1.0' in text
    assert 'weightsync_syncs_total{result="Failed"} 1.0' in text
    assert "weightsync_sync_duration_seconds_count 2.0" in text
    assert 'weightsync_sync_duration_seconds_bucket{le="5.0"} 2.0' in text
    assert "weightsync_synced_bytes_total 1010.0" in text


def test_handlers_are_registered() -> None:
    registry = kopf.get_default_registry()
    ids = {h.id for h in registry._watching.get_all_handlers()}
    ids |= {h.id for h in registry._spawning.get_all_handlers()}
    ids |= {h.id for h in registry._indexing.get_all_handlers()}
    assert {"on_event", "tick", "runtime_pods"} <= ids
    # No change-detecting handlers: nothing is stored in last-handled-configuration.
    assert not [h for h in registry._changing.get_all_handlers() if "weightsync" in h.id]


def test_run_patches_posts_each_event_once_and_counts_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    posted = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(kw["reason"]))
    memo = kopf.Memo(config=OperatorConfig(), pods=FakePods(), metrics=Metrics())
    report = {
        "version": "v1",
        "startedAt": "2025-01-01T00:00:00Z",
        "finishedAt": "2025-01-01T00:00:02Z",
        "result": "Succeeded",
        "movedBytes": 5,
        "seconds": 2.0,
    }
    raw = body(status={"runtime": {"phase": "Idle", "podUid": "p1", "lastReport": report}})
    index = {("ns", "ws"): [pod_for(SPEC)]}
    for _ in range(2):
        patch = kopf.Patch()
        handlers._run(kopf.Body(raw), patch, memo, index)  # type: ignore[arg-type]
        assert patch["status"]["syncedVersion"] == "v1" and "runtime" not in patch["status"]
    assert posted == ["SyncSucceeded"]
    assert 'result="Succeeded"} 1.0' in generate_latest(memo.metrics.registry).decode()
    assert isinstance(memo["lock"], type(threading.Lock()))


def test_index_value_is_the_observed_pod() -> None:
    raw = {"metadata": {"name": "ws-runtime", "uid": "u"}, "status": {"phase": "Running"}}
    out = handlers.runtime_pods(kopf.Body(raw), namespace="ns", labels={"weightsync.io/name": "ws"})
    assert out == {("ns", "ws"): observe_pod(raw)}
