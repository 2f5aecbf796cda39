"""Push through Kubernetes: patch `spec.version` on a WeightSync, wait on its status by a watch.

The trainer needs get, patch and watch on `weightsyncs` in the WeightSync's namespace (no access
to status writes, pods or Secrets). The wait is one watch on the single object, resumed from the
last resourceVersion it delivered (a fresh read when that is too old: 410 Gone), bounded by the
push's deadline on the server side (`timeoutSeconds`) and the client side (the request timeout).
What each delivered object means is decided by `outcome.PushTracker`.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

from sync_runtime.kube.client import load_config
from sync_runtime.schema.crd import GROUP, PLURAL, VERSION, VERSION_PATTERN
from sync_runtime.schema.report import SyncReport
from sync_runtime.trainer.errors import PushTimeout, WeightSyncNotFound
from sync_runtime.trainer.outcome import PushTracker

log = logging.getLogger("weightsync.trainer")
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "weightsync-trainer"
DEFAULT_TIMEOUT_S = 600.0


def _custom_api() -> Any:
    from kubernetes import client

    load_config()
    return client.CustomObjectsApi()


def _transient_errors() -> tuple[type[BaseException], ...]:
    """A dropped or idle watch connection: resume from the last resourceVersion."""
    import urllib3

    return (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError, ConnectionError)


class KubernetesSync:
    """The trainer's handle on WeightSync `namespace/name`.

    `push(version)` returns the SyncReport of `version` once the operator reports it Synced, or
    raises: the runtime's typed `WeightSyncError` (reason of the Synced condition) when the sync
    failed for good, `PushTimeout`, `VersionSuperseded`, `WeightSyncNotFound`.
    `last_push_seconds` is the wall time of the last push from the patch to its outcome.
    """

    def __init__(
        self,
        name: str,
        namespace: str = "default",
        *,
        api: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fail_fast: bool = False,
    ) -> None:
        self.name, self.namespace = name, namespace
        self.timeout_s = timeout_s
        self.fail_fast = fail_fast
        """Raise on the first failed attempt instead of waiting for the runtime's retries."""
        self._api = api
        self.last_push_seconds: float | None = None

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = _custom_api()
        return self._api

    def push(self, version: str, *, timeout_s: float | None = None) -> SyncReport:
        if not re.fullmatch(VERSION_PATTERN, version):
            raise ValueError(f"version {version!r} must match {VERSION_PATTERN}")
        seconds = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + seconds
        before = self._get()
        t0 = time.monotonic()
        patched = self._patch(version)
        tracker = PushTracker.start(version, before, patched, fail_fast=self.fail_fast)
        try:
            report = tracker.observe(patched)
            if report is None:
                report = self._watch(tracker, patched, deadline, seconds)
            return report
        finally:
            self.last_push_seconds = time.monotonic() - t0

    def _get(self) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            return self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)  # type: ignore[no-any-return]
        except ApiException as e:
            if e.status == 404:
                raise WeightSyncNotFound(self.namespace, self.name) from None
            raise

    def _patch(self, version: str) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            return self.api.patch_namespaced_custom_object(  # type: ignore[no-any-return]
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                self.name,
                {"spec": {"version": version}},
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
            )
        except ApiException as e:
            if e.status == 404:  # deleted between the read and the patch
                raise WeightSyncNotFound(self.namespace, self.name) from None
            raise

    def _watch(
        self, tracker: PushTracker, obj: Mapping[str, Any], deadline: float, seconds: float
    ) -> SyncReport:
        from kubernetes.client.rest import ApiException

        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                report, rv = self._watch_once(tracker, rv, remaining)
            except ApiException as e:
                if e.status != 410:
                    raise
                # 410 Gone: our resourceVersion left the watch cache; read the object afresh
                # (what happened in between collapses into its current state) and go on from it.
                fresh = self._get()
                report, rv = tracker.observe(fresh), fresh["metadata"]["resourceVersion"]
            except _transient_errors() as e:
                log.info("watch of %s/%s dropped (%s); resuming at %s", self.namespace, self.name, e, rv)
                continue
            if report is not None:
                return report
        raise PushTimeout(tracker.version, seconds, tracker.phase, tracker.reason)

    def _watch_once(self, tracker: PushTracker, rv: str, remaining: float) -> tuple[SyncReport | None, str]:
        """One watch request from `rv`, ending by the deadline; (outcome or None, last rv seen)."""
        from kubernetes import watch

        w = watch.Watch()
        stream = w.stream(
            self.api.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            field_selector=f"metadata.name={self.name}",
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=max(1, math.ceil(remaining)),
            _request_timeout=remaining + 10.0,  # the server ends the watch first; this bounds a hung one
        )
        try:
            for event in stream:
                body = event.get("raw_object") or event["object"]
                rv = str((body.get("metadata") or {}).get("resourceVersion") or rv)
                if event["type"] == "BOOKMARK":
                    continue
                if event["type"] == "DELETED":
                    raise WeightSyncNotFound(self.namespace, self.name, deleted=True)
                report = tracker.observe(body)
                if report is not None:
                    return report, rv
        finally:
            w.stop()
        return None, rv


__all__ = ["DEFAULT_TIMEOUT_S", "KubernetesSync"]
