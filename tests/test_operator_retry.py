"""Retry/backoff decisions and the runtime pod's fate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from weightsync_operator.pod import MISSING, PodPhase, PodState
from weightsync_operator.retry import PodAction, RetryAction, backoff_seconds, plan_pod, retry_decision

from sync_runtime.schema.crd import RetryPolicy
from sync_runtime.schema.status import RestartStatus

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
POLICY = RetryPolicy(limit=3, backoff_seconds=10, max_backoff_seconds=25)


@pytest.mark.parametrize(("attempts", "seconds"), [(0, 0), (1, 10), (2, 20), (3, 25), (50, 25), (10**6, 25)])
def test_backoff_doubles_and_caps(attempts: int, seconds: float) -> None:
    assert backoff_seconds(attempts, POLICY) == seconds


def test_retry_decision_wait_then_restart_then_give_up() -> None:
    assert retry_decision(0, None, POLICY, T0).action is RetryAction.RESTART
    d = retry_decision(2, T0, POLICY, T0 + timedelta(seconds=19))
    assert d.action is RetryAction.WAIT and d.at == T0 + timedelta(seconds=20)
    assert retry_decision(2, T0, POLICY, T0 + timedelta(seconds=20)).action is RetryAction.RESTART
    assert retry_decision(3, T0, POLICY, T0 + timedelta(hours=1)).action is RetryAction.RESTART
    assert retry_decision(4, T0, POLICY, T0 + timedelta(hours=1)).action is RetryAction.GIVE_UP
    assert retry_decision(1, T0, RetryPolicy(limit=0), T0 + timedelta(hours=1)).action is RetryAction.GIVE_UP


def running(h: str = "h") -> PodState:
    return PodState(phase=PodPhase.RUNNING, name="p", uid="u1", topology_hash=h)


def failed(uid: str = "u1", at: datetime = T0) -> PodState:
    return PodState(
        phase=PodPhase.FAILED,
        name="p",
        uid=uid,
        topology_hash="h",
        exit_code=1,
        message="oom",
        finished_at=at,
    )


def test_missing_pod_is_created_and_healthy_pod_left_alone() -> None:
    assert plan_pod("h", MISSING, RestartStatus(), POLICY, reset=False, now=T0).action is PodAction.CREATE
    assert plan_pod("h", running(), RestartStatus(), POLICY, reset=False, now=T0).action is PodAction.NONE


def test_topology_change_deletes_and_resets_restarts() -> None:
    d = plan_pod("new", running("old"), RestartStatus(count=2), POLICY, reset=False, now=T0)
    assert d.action is PodAction.DELETE and d.restarts.count == 0
    terminating = PodState(phase=PodPhase.TERMINATING, name="p", uid="u1", topology_hash="old")
    assert plan_pod("new", terminating, RestartStatus(), POLICY, reset=False, now=T0).action is PodAction.NONE


def test_failed_pod_counted_once_and_replaced_after_backoff() -> None:
    d = plan_pod("h", failed(), RestartStatus(), POLICY, reset=False, now=T0 + timedelta(seconds=1))
    assert d.action is PodAction.NONE and d.restarts.count == 1
    assert d.restarts.next_restart_time == T0 + timedelta(seconds=10)
    assert (
        d.restarts.last_failed_pod_uid == "u1"
        and "exited with code 1: oom" in d.restarts.last_failure_message
    )
    # Same pod seen again: not counted twice.
    d2 = plan_pod("h", failed(), d.restarts, POLICY, reset=False, now=T0 + timedelta(seconds=10))
    assert d2.action is PodAction.REPLACE and d2.restarts.count == 1 and d2.restarts.next_restart_time is None


def test_retry_limit_exhausted_keeps_failed_pod() -> None:
    restarts = RestartStatus(count=3, last_failed_pod_uid="u3", last_failure_time=T0)
    d = plan_pod("h", failed("u4"), restarts, POLICY, reset=False, now=T0 + timedelta(hours=1))
    assert d.give_up and d.action is PodAction.NONE and d.restarts.count == 4
    # Someone deletes the failed pod: still no new pod until the spec changes.
    d2 = plan_pod("h", MISSING, d.restarts, POLICY, reset=False, now=T0 + timedelta(hours=2))
    assert d2.give_up and d2.action is PodAction.NONE
    # A spec change resets the budget: the failed pod counts as failure 1 and is replaced at once.
    d3 = plan_pod("h", failed("u4"), d.restarts, POLICY, reset=True, now=T0 + timedelta(hours=2))
    assert not d3.give_up and d3.action is PodAction.REPLACE and d3.restarts.count == 1


def test_succeeded_pod_counts_as_ended() -> None:
    done = PodState(phase=PodPhase.SUCCEEDED, name="p", uid="u9", topology_hash="h", exit_code=0)
    d = plan_pod("h", done, RestartStatus(), RetryPolicy(backoff_seconds=0), reset=False, now=T0)
    assert d.action is PodAction.REPLACE and d.restarts.count == 1
