"""The runtime pod: its desired manifest (pure) and what the operator observes of it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sync_runtime.schema.crd import (
    API_VERSION,
    KIND,
    RAY_TOKEN_ENV_PREFIX,
    WeightSyncSpec,
    ray_token_env_name,
)
from weightsync_operator.config import RuntimeDefaults

LABEL_APP = "app.kubernetes.io/name"
RUNTIME_APP = "weightsync-runtime"
LABEL_WS = "weightsync.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_TOPOLOGY = "weightsync.io/topology-hash"
RUNTIME_UID = 10001
"""The image's non-root user (Dockerfile)."""

RESERVED_ENV = frozenset(
    {
        "WEIGHTSYNC_NAMESPACE",
        "WEIGHTSYNC_NAME",
        "POD_NAME",
        "POD_UID",
        "POD_IP",
        "HOME",
    }
)
"""Set by the operator; user env entries with these names (or the token prefix) are dropped."""


def runtime_pod_name(ws_name: str) -> str:
    return f"{ws_name}-runtime"


def topology_hash(spec: WeightSyncSpec) -> str:
    """Digest of everything whose change needs a new runtime pod.

    spec.version is left out (the long-lived runtime picks a new version up through its watch),
    and so are destinations[].pause (the runtime gives its kept server proxies the mode of each
    new spec: engines/vllm_servers.py) and spec.retry (only the operator reads it). A new pod for
    a change the runtime takes up itself would cost a runtime start and race the running pod's
    sync of the same change.
    """
    data = spec.model_dump(by_alias=True, mode="json", exclude={"version", "retry"})
    for dest in data["destinations"]:
        dest.pop("pause", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _env(ws_name: str, namespace: str, spec: WeightSyncSpec, defaults: RuntimeDefaults) -> list[dict]:
    env: list[dict[str, Any]] = [
        {"name": "WEIGHTSYNC_NAMESPACE", "value": namespace},
        {"name": "WEIGHTSYNC_NAME", "value": ws_name},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # The root filesystem is read-only; libraries that write to $HOME get the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
    ]
    for index, ref in enumerate(spec.deployments()):
        if ref.auth_secret_ref is not None:
            secret = {"name": ref.auth_secret_ref.name, "key": ref.auth_secret_ref.key}
            env.append({"name": ray_token_env_name(index), "valueFrom": {"secretKeyRef": secret}})
    for extra in (*defaults.env, *(spec.runtime.env or [])):
        name = str(extra.get("name", ""))
        if name and name not in RESERVED_ENV and not name.startswith(RAY_TOKEN_ENV_PREFIX):
            env.append(dict(extra))
    return env


def _runtime_container(ws_name: str, namespace: str, spec: WeightSyncSpec, defaults: RuntimeDefaults) -> dict:
    rt = spec.runtime
    container: dict[str, Any] = {
        "name": "runtime",
        "image": rt.image or defaults.image,
        "imagePullPolicy": defaults.image_pull_policy,
        # Same entrypoint as the image's runtime mode (Dockerfile); the coordinator reads these flags.
        "command": ["weightsync", "run", "--kubernetes", "--namespace", namespace, "--name", ws_name],
        "env": _env(ws_name, namespace, spec, defaults),
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if rt.resources:
        container["resources"] = rt.resources
    return container


def render_runtime_pod(
    ws_name: str, namespace: str, uid: str, spec: WeightSyncSpec, defaults: RuntimeDefaults
) -> dict[str, Any]:
    """The runtime pod the operator creates for WeightSync `namespace/ws_name` (a Pod manifest dict)."""
    rt = spec.runtime
    container = _runtime_container(ws_name, namespace, spec, defaults)
    pod_spec: dict[str, Any] = {
        # The operator replaces dead pods itself, with backoff and a retry limit (spec.retry).
        "restartPolicy": "Never",
        # The installer's account (chart), never the author's: spec.runtime has no such field.
        "serviceAccountName": defaults.service_account_name,
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if rt.node_selector:
        pod_spec["nodeSelector"] = dict(rt.node_selector)
    if rt.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in rt.tolerations]
    if defaults.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in defaults.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": runtime_pod_name(ws_name),
            "namespace": namespace,
            "labels": {LABEL_APP: RUNTIME_APP, LABEL_WS: ws_name, LABEL_MANAGED_BY: "weightsync-operator"},
            "annotations": {ANNOTATION_TOPOLOGY: topology_hash(spec)},
            # blockOwnerDeletion is left out: it would need update on weightsyncs/finalizers where
            # OwnerReferencesPermissionEnforcement is on, and background GC removes the pod anyway.
            "ownerReferences": [
                {"apiVersion": API_VERSION, "kind": KIND, "name": ws_name, "uid": uid, "controller": True}
            ],
        },
        "spec": pod_spec,
    }


# ---- observation ---------------------------------------------------------------------------------


class PodPhase(StrEnum):
    MISSING = "Missing"
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    TERMINATING = "Terminating"
    UNKNOWN = "Unknown"

    @property
    def ended(self) -> bool:
        """The container exited; with restartPolicy Never the pod will not run again."""
        return self in (PodPhase.SUCCEEDED, PodPhase.FAILED)


ERROR_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Waiting reasons that will not resolve by waiting alone (e.g. the auth Secret is missing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodState:
    """What the operator needs to know of its runtime pod."""

    phase: PodPhase
    name: str | None = None
    uid: str | None = None
    topology_hash: str | None = None
    waiting_reason: str | None = None
    message: str | None = None
    exit_code: int | None = None
    finished_at: datetime | None = None

    @property
    def exists(self) -> bool:
        return self.phase is not PodPhase.MISSING

    @property
    def stuck(self) -> bool:
        return self.waiting_reason in ERROR_WAITING_REASONS


MISSING = PodState(phase=PodPhase.MISSING)


def _time(raw: Any) -> datetime | None:
    if not raw:
        return None
    return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))


def observe_pod(pod: Mapping[str, Any] | None) -> PodState:
    """PodState of a Pod body (None = no pod)."""
    if not pod:
        return MISSING
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    state = (statuses[0].get("state") or {}) if statuses else {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    if meta.get("deletionTimestamp"):
        phase = PodPhase.TERMINATING
    else:
        try:
            phase = PodPhase(status.get("phase") or "Pending")
        except ValueError:
            phase = PodPhase.UNKNOWN
    return PodState(
        phase=phase,
        name=meta.get("name"),
        uid=meta.get("uid"),
        topology_hash=(meta.get("annotations") or {}).get(ANNOTATION_TOPOLOGY),
        waiting_reason=waiting.get("reason"),
        message=(terminated.get("message") or waiting.get("message") or status.get("message") or None),
        exit_code=terminated.get("exitCode"),
        finished_at=_time(terminated.get("finishedAt")),
    )
