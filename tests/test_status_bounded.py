"""The CR's status stays bounded at fleet scale: the runtime's finished patch (status.runtime
with lastReport) and the operator's replica list, for a report of a few thousand ranks.

Control: the same report dumped whole (what lastReport carried before) is far over the bound,
so the test would fail if the per-rank table went back into status.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from weightsync_operator.replicas import replica_statuses

from sync_runtime.kube import status as k8s
from sync_runtime.schema.report import RankBytes, ReplicaState, ReplicaVersion, SyncReport, SyncResult

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
LIMIT = 64 * 1024
SRC_RANKS, DST_TP, DST_REPLICAS = 4096, 16, 128  # 6,144 ranks


def fleet_report() -> SyncReport:
    ranks = [
        RankBytes(
            rank=i,
            role="source",
            name=f"trainer-{i}",
            send_bytes=10**9 + i,
            recv_bytes=0,
        )
        for i in range(SRC_RANKS)
    ]
    ranks += [
        RankBytes(
            rank=SRC_RANKS + i,
            role="destination",
            name=f"infer-{i}",
            send_bytes=0,
            recv_bytes=2 * 10**9 + i,
        )
        for i in range(DST_TP * DST_REPLICAS)
    ]
    replicas = [
        ReplicaVersion(
            deployment="rollout",
            replica=k,
            version="v2",
            state=ReplicaState.SERVING,
            rank_versions=["v2"] * DST_TP,
        )
        for k in range(DST_REPLICAS)
    ]
    replicas[3] = ReplicaVersion(
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
        replicas=replicas,
    )


def size(obj: object) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


def test_finished_patch_is_bounded_at_6144_ranks() -> None:
    report = fleet_report()
    assert size(report.model_dump(by_alias=True, mode="json")) > 8 * LIMIT  # control: the table is big
    patch = k8s.finished_patch(report, T0, "runtime-pod", "uid")
    last = patch["status"]["runtime"]["lastReport"]
    assert last["ranks"] == []  # a merge patch clears an older report's table
    summary = last["rankSummary"]
    assert summary["count"] == SRC_RANKS + DST_TP * DST_REPLICAS
    assert summary["maxSendBytes"] == 10**9 + SRC_RANKS - 1 and summary["busiestSender"] == "trainer-4095"
    assert summary["busiestReceiver"] == f"infer-{DST_TP * DST_REPLICAS - 1}"
    # The operator reads it back, and still names the degraded replica's ranks.
    parsed = SyncReport.model_validate(last)
    statuses = replica_statuses(parsed, [])
    assert statuses[3].rank_versions == ["v1"] + ["v2"] * (DST_TP - 1) and statuses[0].rank_versions == []
    replicas = [s.model_dump(by_alias=True, mode="json") for s in statuses]
    total = size(patch) + size(replicas)
    assert total < LIMIT, f"{total} bytes"


def test_summary_does_not_grow_with_ranks() -> None:
    small = fleet_report().model_copy(update={"ranks": fleet_report().ranks[:10]})
    sizes = [size(k8s.report_json(r)["rankSummary"]) for r in (small, fleet_report())]
    assert max(sizes) < 400 and abs(sizes[0] - sizes[1]) < 40, sizes
