"""PushTracker without an API server: the decisions the e2e watch tests rely on, one body at a time
(tests/e2e/test_trainer_push.py drives the same logic through a real watch)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sync_runtime.errors import TopologyMismatchError
from sync_runtime.schema.report import SyncFailure, SyncReport, SyncResult
from sync_runtime.trainer.errors import VersionSuperseded
from sync_runtime.trainer.outcome import PushTracker

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def rep(version: str, at: int, failure: SyncFailure | None = None) -> dict[str, Any]:
    r = SyncReport(
        version=version,
        started_at=T0,
        finished_at=T0 + timedelta(seconds=at),
        result=SyncResult.FAILED if failure else SyncResult.SUCCEEDED,
        failure=failure,
        seconds=1.0,
    )
    return r.model_dump(by_alias=True, mode="json")


def body(gen: int, version: str, obs: int, synced: tuple[str, str] | None = None, **status: Any) -> dict:
    conds = []
    if synced:
        conds = [
            {"type": "Synced", "status": synced[0], "reason": synced[1], "lastTransitionTime": T0.isoformat()}
        ]
    return {
        "metadata": {"generation": gen},
        "spec": {"version": version, "retry": {"limit": 3}},
        "status": {"observedGeneration": obs, "conditions": conds, **status},
    }


def last(version: str, at: int, result: str = "Succeeded", reason: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "version": version,
        "result": result,
        "finishedAt": (T0 + timedelta(seconds=at)).isoformat(),
    }
    if reason:
        out["failure"] = {"reason": reason, "message": "x"}
    return out


def test_synced_of_an_older_generation_is_ignored_then_ours_is_taken() -> None:
    before = body(1, "v0", 1, ("True", "VersionSynced"), syncedVersion="v1", lastSync=last("v1", 1))
    t = PushTracker.start("v1", before, body(2, "v1", 1))
    assert (
        t.observe(body(2, "v1", 1, ("True", "VersionSynced"), syncedVersion="v1", lastSync=last("v1", 1)))
        is None
    )
    got = t.observe(body(2, "v1", 2, ("True", "VersionSynced"), syncedVersion="v1", lastSync=last("v1", 5)))
    assert got is not None and got.version == "v1"


def test_the_same_version_again_answers_with_its_current_failure() -> None:
    failed = body(
        3, "v1", 3, ("False", "TopologyMismatch"), lastSync=last("v1", 2, "Failed", "TopologyMismatch")
    )
    t = PushTracker.start("v1", failed, failed)  # the patch changed nothing: no new sync will run
    with pytest.raises(TopologyMismatchError):
        t.observe(failed)


def test_superseded_after_our_report_returns_ours() -> None:
    t = PushTracker.start("v1", body(1, "v0", 1), body(2, "v1", 1))
    mine = {"runtime": {"phase": "Idle", "version": "v1", "lastReport": rep("v1", 3)}}
    assert t.observe(body(2, "v1", 1, **mine)) is None  # the operator has not caught up yet
    got = t.observe(body(3, "v2", 3, ("False", "SyncPending"), **mine))
    assert got is not None and got.version == "v1"


def test_superseded_before_ours_ran_raises() -> None:
    t = PushTracker.start("v1", body(1, "v0", 1), body(2, "v1", 1))
    running = {"runtime": {"phase": "Syncing", "version": "v2"}}
    with pytest.raises(VersionSuperseded):
        t.observe(body(3, "v2", 3, ("False", "SyncPending"), **running))


def test_a_version_synced_before_the_patch_answers_with_the_runtimes_report() -> None:
    """The runtime's report of our version was already stored when the push read the object:
    the answer is that report (with its rank summary), not the operator's shorter summary."""
    runtime = {
        "runtime": {
            "phase": "Idle",
            "version": "v1",
            "lastReport": {**rep("v1", 3), "rankSummary": {"count": 4}},
        }
    }
    before = body(1, "v0", 1, **runtime)
    t = PushTracker.start("v1", before, body(2, "v1", 1, **runtime))
    synced = ("True", "VersionSynced")
    got = t.observe(body(2, "v1", 2, synced, syncedVersion="v1", lastSync=last("v1", 3), **runtime))
    assert got is not None and got.rank_summary is not None and got.rank_summary.count == 4
    # Control: without the runtime's report only the operator's summary is at hand.
    bare = t.observe(body(2, "v1", 2, synced, syncedVersion="v1", lastSync=last("v1", 3)))
    assert bare is not None and bare.rank_summary is None
