"""The CR's status stays bounded at fleet scale: the runtime's finished patch (status.runtime
with lastReport) and the operator's replica list, for a report of a few thousand ranks.

Control: the same report dumped whole (what lastReport carried before) is far over the bound,
so the test would fail if the per-rank table went back into status.
"""

from __future__ import annotations

import json

import pytest
from weightsync_operator.replicas import replica_statuses, serving_column

from sync_runtime.kube import status as k8s
from sync_runtime.schema.report import (
    LISTED_REPLICAS,
    ReplicaState,
    SyncReport,
    listed_replicas,
)
from tests.support.fleet import DST_TP, SRC_RANKS, T0, fleet_report

pytestmark = pytest.mark.unit

LIMIT = 64 * 1024
DST_REPLICAS = 128  # 6,144 ranks


def size(obj: object) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


def test_finished_patch_is_bounded_at_6144_ranks() -> None:
    report = fleet_report(DST_REPLICAS)
    assert size(report.model_dump(by_alias=True, mode="json")) > 8 * LIMIT  # control: the table is big
    patch = k8s.finished_patch(report, T0, "runtime-pod", "uid")
    last = patch["status"]["runtime"]["lastReport"]
    assert last["ranks"] == []  # a merge patch clears an older report's table
    summary = last["rankSummary"]
    assert summary["count"] == SRC_RANKS + DST_TP * DST_REPLICAS
    assert summary["maxSendBytes"] == 10**9 + SRC_RANKS - 1 and summary["busiestSender"] == "trainer-4095"
    assert summary["busiestReceiver"] == f"rollout-{DST_TP * DST_REPLICAS - 1}"
    # The operator reads it back, and still names the degraded replica's ranks.
    parsed = SyncReport.model_validate(last)
    statuses = replica_statuses(parsed, [])
    assert len(statuses) == LISTED_REPLICAS and statuses[3].replica == 3
    assert statuses[3].rank_versions == ["v1"] + ["v2"] * (DST_TP - 1) and statuses[0].rank_versions == []
    assert serving_column(parsed, None) == f"{DST_REPLICAS - 1}/{DST_REPLICAS}"  # every replica counted
    replicas = [s.model_dump(by_alias=True, mode="json") for s in statuses]
    total = size(patch) + size(replicas)
    assert total < LIMIT, f"{total} bytes"


def test_status_does_not_grow_with_replicas() -> None:
    """Control: the uncut list at 4,096 replicas would be far over the bound."""
    sizes = {}
    for n in (DST_REPLICAS, 4096):
        report = fleet_report(n)
        patch = k8s.finished_patch(report, T0, "runtime-pod", "uid")
        parsed = SyncReport.model_validate(patch["status"]["runtime"]["lastReport"])
        listed = [s.model_dump(by_alias=True, mode="json") for s in replica_statuses(parsed, [])]
        sizes[n] = size(patch) + size(listed)
        assert parsed.replica_summary is not None and parsed.replica_summary.count == n
    assert abs(sizes[4096] - sizes[DST_REPLICAS]) < 400 and sizes[4096] < LIMIT, sizes
    whole = [r.model_dump(by_alias=True, mode="json") for r in fleet_report(4096).replicas]
    assert size(whole) > 4 * LIMIT


def test_every_replica_out_of_serving_is_listed_before_any_serving_one() -> None:
    report = fleet_report(4096)
    bad = {7, 4000}
    fixed = {"state": ReplicaState.SERVING, "version": "v2"}
    report.replicas[3] = report.replicas[3].model_copy(update=fixed)
    for k in bad:
        report.replicas[k] = report.replicas[k].model_copy(update={"state": ReplicaState.POISONED})
    listed = listed_replicas(report.replicas)
    assert len(listed) == LISTED_REPLICAS and bad <= {r.replica for r in listed}
    assert [r.replica for r in listed] == sorted(r.replica for r in listed)


def test_summary_does_not_grow_with_ranks() -> None:
    small = fleet_report(DST_REPLICAS).model_copy(update={"ranks": fleet_report(DST_REPLICAS).ranks[:10]})
    sizes = [size(k8s.report_json(r)["rankSummary"]) for r in (small, fleet_report(DST_REPLICAS))]
    assert max(sizes) < 400 and abs(sizes[0] - sizes[1]) < 40, sizes
