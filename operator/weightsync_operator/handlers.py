"""kopf wiring. Every trigger runs the same level-triggered reconcile (reconcile.py).

Why watch events and a timer rather than on.update/on.field: kopf leaves `status` out of the
diff essence that on.create/on.update compare, so a runtime report never fires them. A
`field="status.runtime"` handler would fire, but kopf would then store status.runtime (the whole
report, up to hundreds of KB) in its last-handled-configuration annotation on every progress
patch. The on.event handler sees every change of the CR, including status.runtime, at no cost;
the operator's own status writes come back as events too and reconcile to an identical status,
so nothing is written and there is no loop. The timer notices pod deaths (pods are watched
through an in-memory index, not per-pod handlers) and backoff deadlines.
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from typing import Any

import kopf

from sync_runtime.schema.crd import GROUP, PLURAL, VERSION
from sync_runtime.schema.public import public_message
from weightsync_operator.config import OperatorConfig
from weightsync_operator.kube import KubePodApi, load_config
from weightsync_operator.metrics import Metrics
from weightsync_operator.pod import LABEL_APP, LABEL_WS, MISSING, RUNTIME_APP, PodState, observe_pod
from weightsync_operator.reconcile import reconcile

CONFIG = OperatorConfig.from_env(os.environ)
MAX_REMEMBERED_EVENTS = 64


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # No CRD/namespace scanning: the RBAC then needs no cluster-scoped reads (the chart installs the
    # CRD before the operator starts; a CRD added later needs an operator restart).
    settings.scanning.disabled = True
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.loggers = False  # Events only for sync start/success/failure, not every log line
    settings.posting.reporting_component = "weightsync-operator"
    load_config()
    memo.config, memo.pods, memo.metrics = CONFIG, KubePodApi(), Metrics()
    memo.metrics.serve(CONFIG.metrics_port, CONFIG.bind_address)


@kopf.index("pods", labels={LABEL_APP: RUNTIME_APP})
def runtime_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict:
    return {(namespace, labels.get(LABEL_WS, "")): observe_pod(body)}


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_event(
    type: str | None, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, runtime_pods: kopf.Index, **_: Any
) -> None:
    if type != "DELETED":
        _run(body, patch, memo, runtime_pods)


@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.reconcile_interval_seconds)
def tick(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, runtime_pods: kopf.Index, **_: Any) -> None:
    _run(body, patch, memo, runtime_pods)


def _pod_of(body: kopf.Body, index: kopf.Index) -> PodState:
    found = list(index.get((body.metadata.namespace, body.metadata.name), []))
    return found[-1] if found else MISSING


def _run(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, index: kopf.Index) -> None:
    """Serialised per object (watch events and the timer run in different threads)."""
    with memo.setdefault("lock", threading.Lock()):
        result = reconcile(body, _pod_of(body, index), memo.pods, memo.config, datetime.now(UTC))
        if result.status_patch is not None:
            patch.setdefault("status", {}).update(result.status_patch)
        seen: list[str] = memo.setdefault("events_seen", [])
        for event in result.events:
            if event.key in seen:
                continue
            seen[:] = [*seen, event.key][-MAX_REMEMBERED_EVENTS:]
            kopf.event(body, type=event.type, reason=event.reason, message=public_message(event.message))
            if event.result is not None:
                memo.metrics.observe_sync(event.result, event.seconds, event.moved_bytes)
