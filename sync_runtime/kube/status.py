"""The runtime's Kubernetes channel: read the desired spec, report into `status.runtime`.

The runtime pod's ServiceAccount may get/list/watch its WeightSync and patch weightsyncs/status,
nothing else. It writes only `status.runtime` (status.RuntimeStatus), always as a JSON merge patch
on the status subresource, so it never overwrites the operator's fields; the operator derives
phase, conditions, syncedVersion and lastSync from it. Pod identity (POD_NAME/POD_UID, set by
the operator through the downward API) goes into every patch so the operator can ignore what a
replaced pod wrote last.

Patch bodies are built by pure functions (`progress_patch`, `finished_patch`, `phase_patch`);
messages pass `public.public_message`, so a traceback reaches the log only, never status.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from sync_runtime.kube.client import load_config
from sync_runtime.schema.crd import GROUP, PLURAL, VERSION, WeightSyncSpec
from sync_runtime.schema.public import public_message
from sync_runtime.schema.report import (
    ProgressEvent,
    RankSummary,
    ReplicaState,
    ReplicaSummary,
    SyncReport,
    listed_replicas,
)
from sync_runtime.schema.status import RuntimePhase, WeightSyncStatus

log = logging.getLogger("weightsync.k8s")
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "weightsync-runtime"
PROGRESS_INTERVAL_S = 0.5
"""At most two progress patches per second reach the API server."""


def _utc(t: datetime) -> datetime:
    """Report timestamps must be RFC 3339 with a zone (the CRD's date-time format); naive = UTC."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _stamp(t: datetime) -> str:
    return _utc(t).isoformat().replace("+00:00", "Z")


def _runtime(
    fields: dict[str, Any], now: datetime, pod_name: str | None, pod_uid: str | None
) -> dict[str, Any]:
    body = {"podName": pod_name, "podUid": pod_uid, **fields, "heartbeatTime": _stamp(now)}
    if pod_name is None:
        del body["podName"]
    if pod_uid is None:
        del body["podUid"]
    return {"status": {"runtime": body}}


def progress_patch(
    event: ProgressEvent, now: datetime, pod_name: str | None = None, pod_uid: str | None = None
) -> dict[str, Any]:
    fields = {
        "phase": RuntimePhase.SYNCING.value,
        "version": event.version,
        "reason": None,
        "message": None,
        "progress": event.model_dump(by_alias=True, mode="json"),
    }
    return _runtime(fields, now, pod_name, pod_uid)


def report_json(report: SyncReport) -> dict[str, Any]:
    """The report as stored in status.runtime.lastReport: camelCase, UTC timestamps.

    None values stay in as null: in a merge patch they delete what an earlier report left
    (e.g. the failure of a failed sync once a later one succeeds).

    Bounded whatever the fleet's size (etcd refuses objects over 1.5 MiB; 12,288 ranks' table
    alone was about 1.2 MB): the per-rank table becomes `rankSummary` and `ranks` is emptied (the
    runtime's log and `--report` file keep the table); the replica list keeps at most
    `LISTED_REPLICAS` (those out of serving first) beside `replicaSummary`, and a serving
    replica's per-rank versions, all equal to its version, are left out.
    """
    listed = listed_replicas(report.replicas)
    compact = report.model_copy(
        update={
            "ranks": [],
            "rank_summary": RankSummary.of(report.ranks),
            "replicas": [
                r.model_copy(update={"rank_versions": []}) if r.state is ReplicaState.SERVING else r
                for r in listed
            ],
            "replica_summary": ReplicaSummary.of(report.replicas) if report.replicas else None,
        }
    )
    data = compact.model_dump(by_alias=True, mode="json")
    if data.get("failure"):
        # Tracebacks stay in the pod's log; status carries the failure's reason and last line.
        data["failure"]["message"] = public_message(data["failure"].get("message"))
    data["startedAt"], data["finishedAt"] = _stamp(report.started_at), _stamp(report.finished_at)
    return data


def finished_patch(
    report: SyncReport, now: datetime, pod_name: str | None = None, pod_uid: str | None = None
) -> dict[str, Any]:
    fields = {
        "phase": RuntimePhase.IDLE.value,
        "version": report.version,
        "reason": None,
        "message": None,
        "progress": None,
        "lastReport": report_json(report),
    }
    return _runtime(fields, now, pod_name, pod_uid)


def phase_patch(
    phase: RuntimePhase,
    now: datetime,
    *,
    version: str | None = None,
    reason: str | None = None,
    message: str | None = None,
    pod_name: str | None = None,
    pod_uid: str | None = None,
) -> dict:
    text = public_message(message) if message is not None else None
    fields: dict[str, Any] = {"phase": phase.value, "reason": reason, "message": text}
    if version is not None:
        fields["version"] = version
    if phase is not RuntimePhase.SYNCING:
        fields["progress"] = None
    return _runtime(fields, now, pod_name, pod_uid)


def _custom_api() -> Any:
    from kubernetes import client

    load_config()
    return client.CustomObjectsApi()


def _start_timer(delay_s: float, callback: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(delay_s, callback)
    timer.daemon = True  # a pending progress patch must never keep the runtime alive
    timer.start()
    return timer


class KubernetesReporter:
    """report.Reporter that patches status.runtime of WeightSync `namespace/name`.

    progress() is throttled to one patch per PROGRESS_INTERVAL_S; events in between are coalesced
    and the newest is sent when the interval has passed (a timer delivers it even if no further
    event comes, so a long transfer step is visible while it runs) or by flush(). finished() and
    set_phase() always patch (they supersede pending progress). API errors are logged, never
    raised: reporting must not fail a sync (finished() retries a few times first). One lock
    serialises every patch, so a late progress patch can never land after finished().
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        api: Any = None,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        min_interval: float = PROGRESS_INTERVAL_S,
        environ: Mapping[str, str] = os.environ,
        schedule: Callable[[float, Callable[[], None]], Any] | None = None,
    ) -> None:
        self.namespace, self.name = namespace, name
        self._api = api
        self._clock, self._now, self._interval = clock, now, min_interval
        self._schedule = schedule or _start_timer
        self._last_sent = float("-inf")
        self._pending: ProgressEvent | None = None
        self._timer: Any = None
        self._lock = threading.RLock()
        self.pod_name, self.pod_uid = environ.get("POD_NAME"), environ.get("POD_UID")

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = _custom_api()
        return self._api

    def progress(self, event: ProgressEvent) -> None:
        with self._lock:
            self._pending = event
            wait = self._interval - (self._clock() - self._last_sent)
            if wait <= 0:
                self.flush()
            elif self._timer is None:
                self._timer = self._schedule(wait, self.flush)

    def flush(self) -> None:
        with self._lock:
            self._timer = None
            if self._pending is not None:
                event, self._pending = self._pending, None
                self._last_sent = self._clock()
                self._patch(progress_patch(event, self._now(), self.pod_name, self.pod_uid))

    def _drop_pending(self) -> None:
        self._pending = None
        if self._timer is not None and hasattr(self._timer, "cancel"):
            self._timer.cancel()
        self._timer = None

    def finished(self, report: SyncReport) -> None:
        # The full report (per-rank table included) goes to the log; status keeps it bounded.
        log.info("sync report: %s", report.model_dump_json(by_alias=True))
        with self._lock:
            self._drop_pending()
            self._patch(finished_patch(report, self._now(), self.pod_name, self.pod_uid), attempts=3)

    def set_phase(
        self,
        phase: RuntimePhase,
        *,
        version: str | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        """Connecting before joining the Ray clusters, Idle once connected, Failed (with a CamelCase
        reason such as RayClusterUnreachable and a message) when the runtime cannot work at all."""
        with self._lock:
            self._drop_pending()
            self._patch(
                phase_patch(
                    phase,
                    self._now(),
                    version=version,
                    reason=reason,
                    message=message,
                    pod_name=self.pod_name,
                    pod_uid=self.pod_uid,
                )
            )

    def heartbeat(self) -> None:
        with self._lock:
            self._patch(_runtime({}, self._now(), self.pod_name, self.pod_uid))

    def _patch(self, body: dict[str, Any], attempts: int = 1) -> None:
        for attempt in range(attempts):
            try:
                self.api.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    self.name,
                    body,
                    field_manager=FIELD_MANAGER,
                    _content_type=MERGE_PATCH,
                )
                return
            except Exception as e:  # any API or network error: log it, never fail the sync
                log.warning(
                    "status.runtime patch of %s/%s failed (attempt %d/%d): %s",
                    self.namespace,
                    self.name,
                    attempt + 1,
                    attempts,
                    e,
                )
                if attempt + 1 < attempts:
                    time.sleep(0.5 * 2**attempt)


# ---- reading the desired state ---------------------------------------------------------------


def spec_of(obj: Mapping[str, Any]) -> WeightSyncSpec | None:
    """The parsed spec of a WeightSync body, or None (logged) when it cannot be parsed."""
    try:
        return WeightSyncSpec.model_validate(obj.get("spec") or {})
    except ValidationError as e:
        meta = obj.get("metadata") or {}
        log.error("WeightSync %s/%s: unusable spec: %s", meta.get("namespace"), meta.get("name"), e)
        return None


def desired_changed(last_generation: int | None, obj: Mapping[str, Any]) -> bool:
    """True when `obj` carries a spec the runtime has not seen: metadata.generation moves on every
    spec change (version included) and never on status writes, so our own patches are ignored."""
    return (obj.get("metadata") or {}).get("generation") != last_generation


def read_status(namespace: str, name: str, api: Any = None) -> WeightSyncStatus:
    """The CR's current status (e.g. syncedVersion after a runtime restart)."""
    obj = (api or _custom_api()).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return WeightSyncStatus.model_validate(obj.get("status") or {})


def watch_desired(
    namespace: str, name: str, *, api: Any = None, timeout_seconds: int = 300, retry_delay_s: float = 2.0
) -> Iterator[WeightSyncSpec]:
    """Yield the spec now, then again each time it changes (generation); ends when the CR is deleted.

    Changes made while the caller works on a yielded spec collapse into the newest one: after each
    watch window the object is read again and compared by generation.
    """
    from kubernetes import watch
    from kubernetes.client.rest import ApiException

    api = api or _custom_api()
    seen: int | None = None
    while True:
        try:
            obj = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return
            log.warning("reading WeightSync %s/%s failed: %s; retrying", namespace, name, e)
            time.sleep(retry_delay_s)
            continue
        if desired_changed(seen, obj):
            seen = obj["metadata"].get("generation")
            spec = spec_of(obj)
            if spec is not None:
                yield spec
        try:
            stream = watch.Watch().stream(
                api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                field_selector=f"metadata.name={name}",
                resource_version=obj["metadata"]["resourceVersion"],
                timeout_seconds=timeout_seconds,
            )
            for event in stream:
                if event["type"] == "DELETED":
                    return
                if event["type"] in ("ADDED", "MODIFIED") and desired_changed(seen, event["object"]):
                    break  # re-read above, so a long sync in between still ends on the newest spec
        except ApiException as e:
            if e.status != 410:  # 410 Gone: our resourceVersion expired; simply read again
                log.warning("watching WeightSync %s/%s failed: %s; retrying", namespace, name, e)
                time.sleep(retry_delay_s)
