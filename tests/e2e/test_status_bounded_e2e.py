"""The WeightSync object stays small at fleet scale, as stored by a real kube-apiserver.

A report of 6,144 simulated ranks (4,096 trainer ranks, 128 vLLM replicas of TP 16, one of them
degraded) goes through the runtime's own writer (`KubernetesReporter.finished`, a merge patch on
the status subresource), then through the operator's own status derivation and patch
(`derive_status`, `status_patch`). The object read back from the API server (everything etcd
keeps: spec, status.runtime.lastReport, status.replicas, conditions) must stay under 64 KiB and
still carry the rank summary and the degraded replica's per-rank versions; with 16 times the
replicas it stays the same size (lists cut to the replicas out of serving first, then a summary).

Control: the same report stored whole (the per-rank table in lastReport, as before the bound)
makes an object over 64 KiB, read back from the same API server.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from weightsync_operator.pod import PodPhase, PodState
from weightsync_operator.retry import PodAction, PodDecision
from weightsync_operator.status import derive_status, status_patch

from sync_runtime.kube.status import KubernetesReporter
from sync_runtime.schema.crd import GROUP, PLURAL, VERSION, WeightSyncSpec
from sync_runtime.schema.report import (
    LISTED_REPLICAS,
    ReplicaState,
)
from sync_runtime.schema.status import RestartStatus, RuntimeStatus, WeightSyncStatus
from tests.support.fleet import DST_TP, SRC_RANKS, fleet_report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CRD = Path(__file__).resolve().parents[2] / "crds" / "weightsyncs.weightsync.io.yaml"
LIMIT = 64 * 1024
SPEC = {
    "version": "v2",
    "allowUnauthenticatedRay": True,
    "source": {"name": "trainer", "rayAddress": "ray:6379", "actorPrefix": "t-", "layout": "megatron"},
    "destinations": [{"name": "rollout", "rayAddress": "ray:6379", "actorPrefix": "v-", "layout": "vllm"}],
}


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

    # 16 times the replicas: the lists stay cut to LISTED_REPLICAS, the summary counts them all.
    bigger = _stored_fleet(api, namespace, "fleet-x16", 2048)
    grown = _size(bigger) - size
    record_property("bytes_grown_128_to_2048_replicas", grown)
    print(f"\nstored: {size} B at 128 replicas, {size + grown} B at 2,048")
    assert bigger["status"]["serving"] == "2047/2048"
    assert len(bigger["status"]["replicas"]) == LISTED_REPLICAS
    assert bigger["status"]["runtime"]["lastReport"]["replicaSummary"]["count"] == 2048
    assert 3 in {r["replica"] for r in bigger["status"]["replicas"]}  # the degraded one stays named
    assert grown < 200, f"{grown} bytes more at 2,048 replicas than at 128"


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
