"""Pure: what one WeightSync body says about a pushed version (no I/O; the watch feeds it).

`PushTracker.observe(obj)` is called with the body the patch returned, then with every object a
watch delivers; it returns the SyncReport once `version` is synced, raises the typed failure once
the runtime has given up on it, and returns None while there is nothing to decide yet.

The rules, and why:
- Nothing the operator says counts before it has seen our patch: conditions and phase are read
  only once `status.observedGeneration` reaches the generation the patch produced, so a `Synced`
  condition from before the patch is never taken for ours.
- A failure counts only if it is new since the patch (`lastSync` differs from what it was before),
  unless the patch changed nothing (the same version again: no new sync will run, the current
  outcome is the answer). The runtime retries a retryable failure `spec.retry.limit` times, so a
  failed attempt is final only when it is not retryable, or the last attempt (or `fail_fast`).
- Another writer may set a newer version meanwhile. The runtime then finishes (or drops) ours and
  syncs the newest; its own reports (`status.runtime.lastReport`, every write of which a watch
  delivers, in order) tell which: a report for our version decides, a report or a running sync of
  a newer one first means ours was skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from sync_runtime.errors import SyncFailure, SyncStep, WeightSyncError
from sync_runtime.schema.report import StageSeconds, SyncReport, SyncResult
from sync_runtime.schema.status import (
    Condition,
    ConditionType,
    LastSync,
    Phase,
    RuntimePhase,
    WeightSyncStatus,
)
from sync_runtime.trainer.errors import VersionSuperseded

PENDING_REASON = "SyncPending"
FINAL_DEGRADED = frozenset({"InvalidSpec", "RuntimeOverrideRefused", "RetryLimitExceeded"})
"""Degraded reasons nothing but a spec change ends: waiting longer cannot produce a sync."""

log = logging.getLogger("weightsync.trainer")
_Key = tuple[str, datetime | None]
"""A finished sync: (version, finishedAt); tells a new report from one seen before the patch."""


def _status(obj: Mapping[str, Any]) -> WeightSyncStatus:
    try:
        return WeightSyncStatus.model_validate(obj.get("status") or {})
    except ValidationError:  # a half-written or foreign status: nothing to decide from yet
        return WeightSyncStatus()


def _runtime_report(status: WeightSyncStatus) -> SyncReport | None:
    rt = status.runtime
    if rt is None or not rt.last_report:
        return None
    try:
        return SyncReport.model_validate(rt.last_report)
    except ValidationError:
        return None


def _last_key(last: LastSync | None) -> _Key | None:
    return (last.version, last.finished_at) if last is not None else None


def _spec_version(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("spec") or {}).get("version")


def _generation(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 0)


def report_from_last_sync(last: LastSync) -> SyncReport:
    """The operator's summary as a SyncReport (when the runtime's full report is not at hand)."""
    failure = None
    if last.failure is not None:
        f = last.failure
        step = SyncStep(f.step) if f.step in SyncStep.__members__.values() else None
        failure = SyncFailure(reason=f.reason, message=f.message, rank=f.rank, step=step)
    stages = {k: v for k, v in last.stages.items() if k in StageSeconds.model_fields}
    now = datetime.now(UTC)
    return SyncReport(
        version=last.version,
        started_at=last.started_at or now,
        finished_at=last.finished_at or now,
        result=SyncResult(last.result),
        failure=failure,
        planned_bytes=last.planned_bytes,
        moved_bytes=last.moved_bytes,
        seconds=last.seconds,
        throughput_bytes_per_second=last.throughput_bytes_per_second,
        stages=StageSeconds(**stages),
        plan_cached=last.plan_cached,
    )


def error_from_condition(
    cond: Condition, last: LastSync | None, report: SyncReport | None
) -> WeightSyncError:
    """The typed error of a failed sync: reason and message of the Synced condition; where it
    happened from the runtime's report of that sync (or the operator's summary of it)."""
    where = report.failure if report is not None and report.failure is not None else None
    summary = last.failure if last is not None else None
    step = where.step if where else None
    if step is None and summary is not None and summary.step in SyncStep.__members__.values():
        step = SyncStep(summary.step)
    failure = SyncFailure(
        reason=cond.reason,
        message=cond.message,
        rank=where.rank if where else (summary.rank if summary else None),
        step=step,
        tensor=where.tensor if where else None,
        peer=where.peer if where else None,
    )
    return WeightSyncError.from_failure(failure)


@dataclass
class PushTracker:
    """The state of one push between the patch and its outcome."""

    version: str
    generation: int
    """metadata.generation the patch produced (the operator must have observed at least this)."""
    moved: bool
    """The patch changed the spec (False: the version was already the desired one)."""
    baseline_last: _Key | None
    baseline_report: _Key | None
    retry_limit: int = 0
    fail_fast: bool = False
    newer: list[str] = field(default_factory=list)
    """Versions other writers set after ours, oldest first."""
    seen: dict[_Key, SyncReport] = field(default_factory=dict)
    """Runtime reports that finished after the patch."""
    failed_attempts: set[datetime | None] = field(default_factory=set)
    phase: str | None = None
    reason: str | None = None

    @classmethod
    def start(
        cls, version: str, before: Mapping[str, Any], patched: Mapping[str, Any], *, fail_fast: bool = False
    ) -> PushTracker:
        """`before`: the body read just before the patch; `patched`: the body the patch returned."""
        status = _status(before)
        report = _runtime_report(status)
        retry = ((patched.get("spec") or {}).get("retry") or {}).get("limit", 3)
        return cls(
            version=version,
            generation=_generation(patched),
            moved=_generation(patched) != _generation(before),
            baseline_last=_last_key(status.last_sync),
            baseline_report=(report.version, report.finished_at) if report else None,
            retry_limit=int(retry),
            fail_fast=fail_fast,
        )

    def observe(self, obj: Mapping[str, Any]) -> SyncReport | None:
        status = _status(obj)
        self._note_runtime_report(status)
        spec_version = _spec_version(obj)
        later = _generation(obj) > self.generation
        if later and spec_version not in (None, self.version, *self.newer):
            self.newer.append(str(spec_version))
        if status.observed_generation is None or status.observed_generation < self.generation:
            return None  # the operator has not derived a status for our patch yet
        self.phase = status.phase.value if status.phase else None
        synced = status.condition(ConditionType.SYNCED)
        self.reason = synced.reason if synced is not None else None
        if self.newer:
            return self._superseded(status)
        return self._current(status, synced)

    def _note_runtime_report(self, status: WeightSyncStatus) -> None:
        report = _runtime_report(status)
        if report is None:
            return
        key = (report.version, report.finished_at)
        if key != self.baseline_report and key not in self.seen:
            self.seen[key] = report
            if report.version == self.version and report.result is SyncResult.FAILED:
                self.failed_attempts.add(report.finished_at)

    def _mine(self, result: SyncResult) -> SyncReport | None:
        """The newest runtime report for our version with `result`, seen since the patch."""
        found = [r for r in self.seen.values() if r.version == self.version and r.result is result]
        return found[-1] if found else None

    def _current_report(self, status: WeightSyncStatus) -> SyncReport | None:
        """The runtime's report in this object when it is a success of our version, even one
        that was already there before the patch (the version was synced before it was asked)."""
        report = _runtime_report(status)
        ok = report is not None and report.version == self.version and report.result is SyncResult.SUCCEEDED
        return report if ok else None

    def _final(self, failure: SyncFailure | None) -> bool:
        if self.fail_fast or failure is None or not failure.retryable:
            return True
        return len(self.failed_attempts) >= self.retry_limit + 1

    def _current(self, status: WeightSyncStatus, synced: Condition | None) -> SyncReport | None:
        last = status.last_sync
        if synced is not None and synced.status == "True" and status.synced_version == self.version:
            report = self._mine(SyncResult.SUCCEEDED) or self._current_report(status)
            if report is None and last is not None and last.version == self.version:
                log.warning(
                    "push of %s: the runtime's report is not in status (reports seen: %s); "
                    "answering with the operator's lastSync",
                    self.version,
                    sorted((v, str(t)) for v, t in self.seen),
                )
                report = report_from_last_sync(last)
            return report  # None only until lastSync names our version (the same write, in practice)
        fresh = not self.moved or _last_key(last) != self.baseline_last
        if (
            synced is not None
            and synced.status == "False"
            and synced.reason != PENDING_REASON
            and last is not None
            and last.version == self.version
            and last.result == SyncResult.FAILED.value
            and fresh
        ):
            self.failed_attempts.add(last.finished_at)
            report = self._mine(SyncResult.FAILED)
            failure = report.failure if report is not None else report_from_last_sync(last).failure
            if self._final(failure):
                raise error_from_condition(synced, last, report)
        degraded = status.condition(ConditionType.DEGRADED)
        if status.phase is Phase.FAILED and degraded is not None and degraded.reason in FINAL_DEGRADED:
            self.reason = degraded.reason
            raise WeightSyncError.from_failure(SyncFailure(reason=degraded.reason, message=degraded.message))
        return None

    def _superseded(self, status: WeightSyncStatus) -> SyncReport | None:
        ok = self._mine(SyncResult.SUCCEEDED)
        if ok is not None:
            return ok  # ours finished before the runtime moved on
        failed = self._mine(SyncResult.FAILED)
        if failed is not None and failed.failure is not None and self._final(failed.failure):
            raise WeightSyncError.from_failure(failed.failure)
        newest = self.newer[-1]
        rt = status.runtime
        moved_on = any(r.version in self.newer for r in self.seen.values()) or (
            rt is not None and rt.phase is RuntimePhase.SYNCING and rt.version in self.newer
        )
        if moved_on:
            raise VersionSuperseded(self.version, newest)
        return None


__all__ = ["PushTracker", "error_from_condition", "report_from_last_sync"]
