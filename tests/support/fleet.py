"""A fleet-sized sync report (simulated ranks, no process): what the bounded-status tests store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sync_runtime.schema.report import RankBytes, ReplicaState, ReplicaVersion, SyncReport, SyncResult

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SRC_RANKS, DST_TP = 4096, 16
DEGRADED_REPLICA = 3


def fleet_report(replicas: int) -> SyncReport:
    """SRC_RANKS trainer ranks into `replicas` vLLM replicas of TP DST_TP, all on v2 but replica
    DEGRADED_REPLICA, whose first rank still holds v1."""
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
    states[DEGRADED_REPLICA] = ReplicaVersion(
        deployment="rollout",
        replica=DEGRADED_REPLICA,
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
