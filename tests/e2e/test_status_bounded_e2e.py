"""The WeightSync object stays small at fleet scale, as stored by a real kube-apiserver.

A report of 6,144 simulated ranks (4,096 trainer ranks, 128 vLLM replicas of TP 16, one of them
degraded) goes through the runtime's own writer (`KubernetesReporter.finished`, a merge patch on
the status subresource), then through the operator's own status derivation and patch
(`derive_status`, `status_patch`). The object read back from the API server (everything etcd
keeps: spec, status.runtime.lastReport, status.replicas, conditions) must stay under 64 KiB and
still carry the rank summary and the degraded replica's per-rank versions.

Control: the same report stored whole (the per-rank table in lastReport, as before the bound)
makes an object over 64 KiB, read back from the same API server. The bytes each serving replica
still costs are measured from a second fleet with twice the replicas and reported.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from weightsync_operator.pod import PodPhase, PodState
from weightsync_operator.retry import PodAction, PodDecision
from weightsync_operator.status import derive_status, status_patch

from sync_runtime.kube.status import KubernetesReporter
from sync_runtime.schema.crd import GROUP, PLURAL, VERSION, WeightSyncSpec
from sync_runtime.schema.report import RankBytes, ReplicaState, ReplicaVersion, SyncReport, SyncResult
from sync_runtime.schema.status import RestartStatus, RuntimeStatus, WeightSyncStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CRD = Path(__file__).resolve().parents[2] / "crds" / "weightsyncs.weightsync.io.yaml"
LIMIT = 64 * 1024
SRC_RANKS, DST_TP = 4096, 16
SPEC = {
    "version": "v2",
    "allowUnauthenticatedRay": True,
    "source": {"name": "trainer", "rayAddress": "ray:6379", "actorPrefix": "t-", "layout": "megatron"},
    "destinations": [{"name": "rollout", "rayAddress": "ray:6379", "actorPrefix": "v-", "layout": "vllm"}],
}
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def fleet_report(replicas: int) -> SyncReport:
    ranks = [
        RankBytes(rank=i, role="source", name=f"trainer-{i}", send_bytes=10**9 + i, recv_bytes=0)
        for i in range(SRC_RANKS)
    ]
    ranks += [
        RankBytes(rank=SRC_RANKS + i, role="destination", name=f"rollout-{i}", send_bytes=0,
                  recv_bytes=2 * 10**9 + i)
        for i in range(DST_TP * replicas)
    ]  # fmt: skip
    states = [
        ReplicaVersion(deployment="rollout", replica=k, version="v2", state=ReplicaState.SERVING,
                       rank_versions=["v2"] * DST_TP)
        for k in range(replicas)
    ]  # fmt: skip
    states[3] = ReplicaVersion(
        deployment="rollout",
        replica=3,
        version=None,
        state=ReplicaState.DEGRADED,
        rank_versions=["v1"] + ["v2"] * (DST_TP - 1),
    )
    return SyncReport(
        version="v2",
        started_at=T0,
        finished_at=T0 + timedelta(seconds=3),
        result=SyncResult.SUCCEEDED,
        ranks=ranks,
        replicas=states,
    )


@pytest.fixture(scope="module")
def api(control_plane: Any, kubectl: Any) -> Any:
    from kubernetes import client

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io", "--timeout=60s")
    return client.CustomObjectsApi(control_plane.api_client())


def _create(api: Any, namespace: str, name: str) -> dict[str, Any]:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightSync",
        "metadata": {"name": name},
        "spec": SPEC,
    }
    return dict(api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body))


def _get(api: Any, namespace: str, name: str) -> dict[str, Any]:
    return dict(api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))


def _size(obj: dict[str, Any]) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


def _operator_writes(api: Any, namespace: str, name: str) -> None:
    """What the operator's reconcile writes after the runtime's report: its derived status."""
    obj = _get(api, namespace, name)
    runtime = RuntimeStatus.model_validate(obj["status"]["runtime"])
    pod = PodState(phase=PodPhase.RUNNING, name=f"{name}-runtime", uid="pod-1")
    status, _ = derive_status(
        WeightSyncSpec.model_validate(obj["spec"]),
        obj["metadata"]["generation"],
        pod,
        runtime,
        WeightSyncStatus(),
        datetime.now(UTC),
        decision=PodDecision(PodAction.NONE, RestartStatus()),
        ws_name=name,
    )
    patch = status_patch(status, obj.get("status"))
    assert patch is not None
    api.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": patch},
        _content_type="application/merge-patch+json",
    )


def _stored_fleet(api: Any, namespace: str, name: str, replicas: int) -> dict[str, Any]:
    _create(api, namespace, name)
    KubernetesReporter(namespace, name, api=api, environ={}).finished(fleet_report(replicas))
    _operator_writes(api, namespace, name)
    return _get(api, namespace, name)


def test_stored_object_stays_under_64kib_at_6144_ranks(
    api: Any, namespace: str, record_property: Any
) -> None:
    stored = _stored_fleet(api, namespace, "fleet", 128)
    size = _size(stored)
    record_property("stored_bytes_6144_ranks", size)
    last = stored["status"]["runtime"]["lastReport"]
    assert last["rankSummary"]["count"] == SRC_RANKS + DST_TP * 128  # kept by the CRD's schema
    assert last["rankSummary"]["busiestSender"] == f"trainer-{SRC_RANKS - 1}"
    assert not last.get("ranks")
    degraded = [r for r in stored["status"]["replicas"] if r["state"] == ReplicaState.DEGRADED.value]
    assert [(r["replica"], r["rankVersions"][0]) for r in degraded] == [(3, "v1")]
    assert stored["status"]["serving"] == "127/128"
    assert size < LIMIT, f"stored WeightSync is {size} bytes"

    # The bytes a serving replica still adds (lastReport.replicas + status.replicas).
    bigger = _size(_stored_fleet(api, namespace, "fleet-x2", 256))
    per_replica = (bigger - size) / 128
    record_property("bytes_per_serving_replica", per_replica)
    print(f"\nstored: {size} B at 128 replicas, {bigger} B at 256; {per_replica:.0f} B per serving replica")


def test_control_the_per_rank_table_in_status_exceeds_64kib(api: Any, namespace: str) -> None:
    _create(api, namespace, "unbounded")
    whole = fleet_report(128).model_dump(by_alias=True, mode="json")  # the table, as before the bound
    body = {"status": {"runtime": {"phase": "Idle", "version": "v2", "lastReport": whole}}}
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "unbounded", body, _content_type="application/merge-patch+json"
    )
    stored = _get(api, namespace, "unbounded")
    assert len(stored["status"]["runtime"]["lastReport"]["ranks"]) == SRC_RANKS + DST_TP * 128
    assert _size(stored) > 8 * LIMIT
