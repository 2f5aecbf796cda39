"""Per-replica status (pure): which version each destination replica serves, and why one does not.

The runtime's report lists every destination replica after the commit phase (or after the
recovery that opened a sync); the operator keeps that list in `status.replicas` until a later
report carries a new one. A report without replicas (a sync that failed before its commit, e.g.
at discovery) says nothing about them, so the last known list stays.

The list is bounded: at most `LISTED_REPLICAS` entries, those out of serving first (the runtime
cuts it so, and the operator cuts a list from an older runtime the same way); the `serving`
column counts every replica, from the report's `replicaSummary` where the list was cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from sync_runtime.schema.report import ReplicaState, SyncReport, listed_replicas
from sync_runtime.schema.status import ReplicaStatus

OUT_OF_SERVING_REASONS = {
    ReplicaState.DEGRADED.value: "MixedVersions",
    ReplicaState.POISONED.value: "ReplicaPoisoned",
}
"""The reason a replica state implies when the report gives none (older runtimes)."""


def replica_statuses(report: SyncReport | None, prior: Sequence[ReplicaStatus]) -> list[ReplicaStatus]:
    if report is None or not report.replicas:
        return list(prior)
    return [
        ReplicaStatus(
            deployment=r.deployment,
            replica=r.replica,
            version=r.version,
            state=r.state.value,
            reason=r.reason,
            rank_versions=list(r.rank_versions),
            pause_seconds=r.pause_seconds,
        )
        for r in listed_replicas(report.replicas)
    ]


def serving_column(report: SyncReport | None, prior: str | None) -> str | None:
    """ "1/2": replicas serving one complete version, of all; None before any report named them.

    Counted from the report's summary (every replica, listed or not); a report that names no
    replica keeps the `prior` column, as the list itself stays."""
    if report is not None and report.replica_summary is not None and report.replica_summary.count:
        return f"{report.replica_summary.serving}/{report.replica_summary.count}"
    if report is not None and report.replicas:
        serving = sum(r.state is ReplicaState.SERVING for r in report.replicas)
        return f"{serving}/{len(report.replicas)}"
    return prior


def _ranks(r: ReplicaStatus) -> str:
    return ", ".join(v or "none" for v in r.rank_versions)


def out_of_serving(replicas: Sequence[ReplicaStatus]) -> tuple[str, str] | None:
    """(reason, message) naming every replica kept out of serving, or None when all serve."""
    bad = [r for r in replicas if r.state != ReplicaState.SERVING.value]
    if not bad:
        return None
    reason = bad[0].reason or OUT_OF_SERVING_REASONS.get(bad[0].state, "ReplicaOutOfServing")
    parts = [f"{r.deployment} replica {r.replica} is {r.state} (ranks on {_ranks(r)})" for r in bad]
    return reason, "; ".join(parts) + "; kept out of serving until the next sync repairs it"
