"""What to do with the runtime pod: create, delete, replace after backoff, or give up (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from sync_runtime.schema.crd import RetryPolicy
from sync_runtime.schema.public import public_message
from sync_runtime.schema.status import RestartStatus
from weightsync_operator.pod import PodPhase, PodState


class RetryAction(StrEnum):
    RESTART = "Restart"
    WAIT = "Wait"
    GIVE_UP = "GiveUp"


@dataclass(frozen=True, slots=True)
class RetryDecision:
    action: RetryAction
    at: datetime | None = None
    """When the restart may happen (WAIT) or happens (RESTART)."""


def backoff_seconds(attempts: int, policy: RetryPolicy) -> float:
    """Delay before replacing the pod after its `attempts`-th failure: backoff*2^(attempts-1), capped."""
    if attempts <= 0:
        return 0.0
    # The exponent is clamped so a large retry limit cannot overflow into a huge integer.
    return float(min(policy.backoff_seconds * 2 ** min(attempts - 1, 40), policy.max_backoff_seconds))


def retry_decision(
    attempts: int, last_failure_time: datetime | None, policy: RetryPolicy, now: datetime
) -> RetryDecision:
    """`attempts` failures so far, the last at `last_failure_time`: restart now, wait, or give up.

    retry.limit is the number of replacements: the (limit+1)-th failure is final.
    """
    if attempts > policy.limit:
        return RetryDecision(RetryAction.GIVE_UP)
    if attempts <= 0 or last_failure_time is None:
        return RetryDecision(RetryAction.RESTART, now)
    at = last_failure_time + timedelta(seconds=backoff_seconds(attempts, policy))
    if now >= at:
        return RetryDecision(RetryAction.RESTART, now)
    return RetryDecision(RetryAction.WAIT, at)


class PodAction(StrEnum):
    NONE = "None"
    CREATE = "Create"
    DELETE = "Delete"
    """Topology changed: delete now, create once it is gone."""
    REPLACE = "Replace"
    """The pod ended and its backoff passed: delete it and create a new one."""


@dataclass(frozen=True, slots=True)
class PodDecision:
    action: PodAction
    restarts: RestartStatus
    give_up: bool = False


def plan_pod(
    desired_hash: str,
    pod: PodState,
    restarts: RestartStatus,
    policy: RetryPolicy,
    *,
    reset: bool,
    now: datetime,
) -> PodDecision:
    """Decide the runtime pod's fate. `reset`: the spec changed or a sync succeeded since the last failure.

    An ended pod is kept until its backoff passes (so `kubectl logs` still works) and kept for
    good once retries are exhausted; a failure is counted once per pod uid.
    """
    if reset:
        restarts = RestartStatus()
    if pod.phase is PodPhase.TERMINATING:
        return PodDecision(PodAction.NONE, restarts)
    if pod.exists and pod.topology_hash != desired_hash:
        return PodDecision(PodAction.DELETE, RestartStatus())
    if pod.phase.ended:
        if pod.uid != restarts.last_failed_pod_uid:
            restarts = RestartStatus(
                count=restarts.count + 1,
                last_failure_time=pod.finished_at or now,
                last_failed_pod_uid=pod.uid,
                last_failure_message=_failure_message(pod),
            )
        decision = retry_decision(restarts.count, restarts.last_failure_time, policy, now)
        if decision.action is RetryAction.GIVE_UP:
            return PodDecision(PodAction.NONE, _next(restarts, None), give_up=True)
        if decision.action is RetryAction.WAIT:
            return PodDecision(PodAction.NONE, _next(restarts, decision.at))
        return PodDecision(PodAction.REPLACE, _next(restarts, None))
    if not pod.exists:
        if restarts.count > policy.limit:
            # Someone removed the last failed pod; stay Failed until the spec changes.
            return PodDecision(PodAction.NONE, restarts, give_up=True)
        return PodDecision(PodAction.CREATE, _next(restarts, None))
    return PodDecision(PodAction.NONE, restarts)


def _next(restarts: RestartStatus, at: datetime | None) -> RestartStatus:
    return restarts.model_copy(update={"next_restart_time": at})


def _failure_message(pod: PodState) -> str:
    code = "" if pod.exit_code is None else f" with code {pod.exit_code}"
    # The termination message is the log tail (FallbackToLogsOnError): often a traceback.
    detail = f": {public_message(pod.message.strip())[-512:]}" if pod.message else ""
    return f"runtime pod {pod.name} exited{code}{detail}"
