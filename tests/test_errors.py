"""The one failure hierarchy (`sync_runtime.errors`): its table, its wire form, and the rule that
nothing classifies a failure by reading its message."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from sync_runtime import errors
from sync_runtime.errors import (
    REASONS,
    Reason,
    SyncFailure,
    SyncStep,
    WeightSyncError,
    describe_unexpected,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def _kinds() -> list[type[WeightSyncError]]:
    out, pending = [], [WeightSyncError]
    while pending:
        kind = pending.pop()
        out.append(kind)
        pending.extend(kind.__subclasses__())
    return sorted(set(out), key=lambda k: k.__name__)


def test_every_reason_has_an_entry() -> None:
    assert set(REASONS) == set(Reason)
    assert {k.reason for k in _kinds()} <= set(Reason)


def test_every_kind_lives_in_the_errors_module() -> None:
    # One hierarchy: a subclass defined elsewhere would be a second place to look for a reason.
    assert {k.__module__ for k in _kinds()} == {errors.__name__}


@pytest.mark.parametrize("kind", _kinds(), ids=lambda k: k.__name__)
def test_round_trip_keeps_kind_and_fields(kind: type[WeightSyncError]) -> None:
    e = kind("rank 3: it broke", rank=3, step=SyncStep.VERIFY, tensor="layers.0.w", peer=1)
    failure = e.to_failure()
    assert failure == SyncFailure(
        reason=kind.reason.value,
        message="rank 3: it broke",
        rank=3,
        step="verify",
        tensor="layers.0.w",
        peer=1,
    )
    wire = SyncFailure.model_validate_json(failure.model_dump_json(by_alias=True))
    assert wire == failure
    back = WeightSyncError.from_failure(wire)
    assert back.reason is kind.reason  # as the most general class of that reason (never invents detail)
    assert back.to_failure() == failure
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is kind and again.to_failure() == failure and str(again) == str(e)


@pytest.mark.parametrize("kind", _kinds(), ids=lambda k: k.__name__)
def test_defaults_and_located(kind: type[WeightSyncError]) -> None:
    e = kind("m")
    assert (e.rank, e.tensor, e.peer, e.step) == (None, None, None, kind.step_default)
    e.located(rank=2, step=SyncStep.COMMIT, peer=None)
    assert e.rank == 2 and e.step is (kind.step_default or SyncStep.COMMIT)  # known fields stay


def test_unknown_reason_reads_back_as_the_base_class() -> None:
    failure = SyncFailure(reason="SomethingNewer", message="from a newer runtime", rank=1)
    e = WeightSyncError.from_failure(failure)
    assert type(e) is WeightSyncError and e.rank == 1 and e.message == "from a newer runtime"
    assert failure.retryable and failure.root_cause == 1
    assert e.to_failure().reason == "SomethingNewer"  # passed on, not turned into InternalError


def test_root_cause_order_and_retryable() -> None:
    def cause(kind: type[WeightSyncError]) -> int:
        return kind("m").to_failure().root_cause

    assert cause(errors.ParticipantDied) < cause(errors.SourceError) < cause(errors.TransferTimeout)
    assert cause(errors.TransferTimeout) < cause(errors.PeerFailed)
    assert cause(errors.ChecksumMismatch) < cause(errors.PeerFailed)
    for kind in (errors.TopologyMismatchError, errors.LayoutError, errors.PlanError, errors.TopologyError):
        assert not kind("m").to_failure().retryable, kind
    for kind in (errors.TransferTimeout, errors.ParticipantDied, errors.RayUnreachableError):
        assert kind("m").to_failure().retryable, kind


def test_ray_unreachable_is_the_loops_reason() -> None:
    assert errors.RayUnreachableError.reason.value == "RayClusterUnreachable"


def test_describe_unexpected_is_one_line() -> None:
    try:
        raise RuntimeError("first\n  Traceback (most recent call last):\n  File x\nthe cause")
    except RuntimeError as e:
        text = describe_unexpected(e)
    assert text == "RuntimeError: the cause"


MESSAGE_SNIFFING = re.compile(r'" in str\(|in .*\.error|\.lower\(\)')


def _sources() -> list[Path]:
    """Production sources: the test harness (sync_runtime/testing) reports to tests, not to users."""
    testing = ROOT / "sync_runtime" / "testing"
    runtime = [p for p in (ROOT / "sync_runtime").rglob("*.py") if testing not in p.parents]
    return sorted([*runtime, *(ROOT / "operator").rglob("*.py")])


def test_no_failure_is_classified_by_its_message() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _sources()
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if MESSAGE_SNIFFING.search(line)
    ]
    assert hits == []


def test_no_traceback_text_in_failures() -> None:
    # Tracebacks go to the logs (logging's exc_info), never into a failure, a status or an Event.
    assert [str(p.relative_to(ROOT)) for p in _sources() if "traceback.format_exc" in p.read_text()] == []
