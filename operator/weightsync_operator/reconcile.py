"""One reconcile of one WeightSync: parse -> decide (pure) -> act on the pod -> the status patch.

Called from every kopf trigger (watch events of the CR, the periodic timer); level-triggered,
so a missed or repeated trigger does no harm.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from pydantic import ValidationError

from sync_runtime.schema.crd import WeightSyncSpec, ray_deployments, spec_problems
from sync_runtime.schema.report import SyncResult
from sync_runtime.schema.status import WeightSyncStatus
from weightsync_operator.config import OperatorConfig, RuntimeDefaults
from weightsync_operator.overrides import REASON as OVERRIDE_REFUSED
from weightsync_operator.overrides import override_problems
from weightsync_operator.pod import PodState, render_runtime_pod, topology_hash
from weightsync_operator.retry import PodAction, PodDecision, plan_pod
from weightsync_operator.status import SyncEvent, derive_status, parse_report, status_patch

log = logging.getLogger("weightsync.operator")


class PodApi(Protocol):
    """The two pod writes the operator makes; both idempotent (404/409 are not errors). Refusals
    raise an exception whose message is shown in the Degraded condition (reason PodCreateFailed)."""

    def create_pod(self, namespace: str, body: dict[str, Any]) -> None: ...

    def delete_pod(self, namespace: str, name: str, uid: str | None) -> None: ...


@dataclass(slots=True)
class ReconcileResult:
    status_patch: dict[str, Any] | None
    events: list[SyncEvent] = field(default_factory=list)
    decision: PodDecision | None = None


def parse_spec(body: Mapping[str, Any]) -> tuple[WeightSyncSpec | None, str | None]:
    try:
        spec = WeightSyncSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        return None, f"spec cannot be parsed: {e.errors()[0].get('loc')}: {e.errors()[0].get('msg')}"
    problems = spec_problems(spec)
    return (None, "; ".join(problems)) if problems else (spec, None)


def judge_spec(
    body: Mapping[str, Any], defaults: RuntimeDefaults
) -> tuple[WeightSyncSpec | None, str | None, str]:
    """parse_spec, then the installer's allowlist: (spec or None, why not, condition reason)."""
    spec, error = parse_spec(body)
    if spec is None:
        return None, error, "InvalidSpec"
    refused = override_problems(spec, defaults)
    return (None, "; ".join(refused), OVERRIDE_REFUSED) if refused else (spec, None, "InvalidSpec")


def unauthenticated_ray_event(spec: WeightSyncSpec | None, generation: int | None) -> list[SyncEvent]:
    """The author opted out of Ray token auth: say so where everyone watching the CR sees it."""
    if spec is None or not spec.allow_unauthenticated_ray:
        return []
    # vllmServers destinations join no Ray cluster of their own (the source's, through the runtime)
    unauth = [d.name for d in ray_deployments(spec) if d.auth_secret_ref is None]
    msg = f"allowUnauthenticatedRay: {', '.join(unauth) or 'no deployment'} connect(s) without a Ray token"
    return [SyncEvent("Warning", "UnauthenticatedRay", msg, key=f"noauth/{generation}")]


def _succeeded_since_failure(prior: WeightSyncStatus) -> bool:
    """A sync succeeded after the last runtime failure: the retry budget starts over."""
    report = parse_report(prior.runtime)
    failed_at = prior.restarts.last_failure_time
    return (
        report is not None
        and failed_at is not None
        and report.result is SyncResult.SUCCEEDED
        and report.finished_at > failed_at
    )


def reconcile(
    body: Mapping[str, Any], pod: PodState, api: PodApi, config: OperatorConfig, now: datetime
) -> ReconcileResult:
    meta = body.get("metadata") or {}
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    prior = WeightSyncStatus.model_validate(body.get("status") or {})
    spec, spec_error, spec_reason = judge_spec(body, config.runtime)
    desired_hash = topology_hash(spec) if spec is not None else None
    pod_error: str | None = None
    if spec is None or desired_hash is None:
        decision = PodDecision(PodAction.NONE, prior.restarts)
    else:
        reset = generation != prior.observed_generation or _succeeded_since_failure(prior)
        decision = plan_pod(desired_hash, pod, prior.restarts, spec.retry, reset=reset, now=now)
        try:
            _apply(
                decision,
                pod,
                api,
                namespace,
                lambda: render_runtime_pod(name, namespace, meta["uid"], spec, config.runtime),
            )
        except Exception as e:  # the API's refusal goes into status instead of a crash loop of the handler
            log.warning("runtime pod of %s/%s: %s", namespace, name, e, exc_info=True)
            pod_error = str(e) or type(e).__name__
    status, events = derive_status(
        spec,
        generation,
        pod,
        prior.runtime,
        prior,
        now,
        decision=decision,
        spec_error=spec_error,
        desired_hash=desired_hash,
        ws_name=name,
        pod_error=pod_error,
        spec_reason=spec_reason,
    )
    events = unauthenticated_ray_event(spec, generation) + events
    return ReconcileResult(status_patch(status, body.get("status")), events, decision)


def _apply(decision: PodDecision, pod: PodState, api: PodApi, namespace: str, render: Any) -> None:
    if decision.action in (PodAction.DELETE, PodAction.REPLACE) and pod.name:
        log.info("deleting runtime pod %s/%s (%s)", namespace, pod.name, decision.action.value)
        api.delete_pod(namespace, pod.name, pod.uid)
    if decision.action in (PodAction.CREATE, PodAction.REPLACE):
        body = render()
        log.info("creating runtime pod %s/%s", namespace, body["metadata"]["name"])
        api.create_pod(namespace, body)
