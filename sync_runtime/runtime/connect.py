"""Connecting the runtime to the participants' Ray cluster, with the mounted auth token."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

import ray

from sync_runtime.errors import RayUnreachableError, WeightSyncError, describe_unexpected
from sync_runtime.schema import crd
from sync_runtime.schema.crd import RayClusterReader, WeightSyncSpec


def _kube_reader() -> RayClusterReader:
    """The RayCluster reader for `rayCluster:` deployments; imported on use, so a spec with
    plain rayAddress deployments never needs the kubernetes client."""
    from sync_runtime.kube.raycluster import read_raycluster

    return read_raycluster


def resolve_address(spec: WeightSyncSpec, namespace: str | None = None) -> str | None:
    """The one Ray address of all deployments (None when they disagree, name none, or a named
    RayCluster cannot be resolved now: the caller then reconnects and reports why)."""
    namespace = namespace or os.environ.get("POD_NAMESPACE", "default")
    read = _kube_reader()
    try:
        addresses = {crd.resolve_ray_address(r, namespace, read) for r in crd.ray_deployments(spec)}
    except (ValueError, WeightSyncError):
        return None
    return addresses.pop() if len(addresses) == 1 else None


def connect_ray(spec: WeightSyncSpec, namespace: str | None = None) -> str:
    """Connect this process to the one Ray cluster all deployments live in (once per process).

    Returns the resolved address; a process already connected (the demo's driver) is reused.
    """
    namespace = namespace or os.environ.get("POD_NAMESPACE", "default")
    refs = crd.ray_deployments(spec)  # vllmServers destinations are attached in this cluster
    read = _kube_reader()
    try:
        addresses = [crd.resolve_ray_address(r, namespace, read) for r in refs]
    except ValueError as e:
        raise RayUnreachableError(str(e)) from e
    if len(set(addresses)) != 1:
        listed = ", ".join(f"{r.name}={a}" for r, a in zip(refs, addresses, strict=True))
        raise RayUnreachableError(f"all deployments must share one Ray cluster; got {listed}")
    address = addresses[0]
    if ray.is_initialized():
        return address
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except Exception as e:  # ray.init raises ConnectionError, ValueError, RuntimeError...
        mismatch = version_mismatch_line(e)
        if mismatch is not None:
            raise RayUnreachableError(f"Ray at {address}: {mismatch}") from e
        raise RayUnreachableError(f"cannot connect to Ray at {address}: {describe_unexpected(e)}") from e
    return address


_GCS_MISMATCH = re.compile(
    r"cluster was started with:\s*Ray: (\S+)\s*Python: (\S+)\s*This process.*?started with:"
    r"\s*Ray: (\S+)\s*Python: (\S+)",
    re.S,
)


def version_mismatch_line(error: BaseException) -> str | None:
    """Ray's multi-line version refusal as one line naming both versions; None for any other error.

    A driver (`ray.init("host:6379")`) and Ray Client (`ray://`) both refuse through Ray's
    `check_version_info`, so one pattern reads either."""
    text = str(error)
    found = _GCS_MISMATCH.search(text)
    if found:
        ray_c, py_c, ray_r, py_r = found.groups()
        return (
            f"version mismatch: the cluster runs Ray {ray_c} (Python {py_c}), this runtime Ray {ray_r} "
            f"(Python {py_r}); build the runtime image with the cluster's Ray and Python"
        )
    return None


def ray_token_from_env() -> str | None:
    """The Ray auth token the operator mounted (`crd.ray_token_env_name`), source's first.

    All deployments share one cluster, hence one token. Never logged.
    """
    for index in range(crd.MAX_DESTINATIONS + 1):
        value = os.environ.get(crd.ray_token_env_name(index), "").strip()
        if value:
            return value
    return None


def ensure_ray_auth_env(argv: Sequence[str]) -> None:
    """Make Ray see the mounted token, the documented way: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN
    in the environment *before* Ray is imported (Ray caches its auth config at import time).

    When Ray is already imported (the CLI imports it with the coordinator), re-execute the same
    command with the variables set; the token travels in the environment, never in argv.
    """
    token = ray_token_from_env()
    if not token or (
        os.environ.get("RAY_AUTH_TOKEN") == token and os.environ.get("RAY_AUTH_MODE") == "token"
    ):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    if "ray" in sys.modules:
        os.execv(sys.executable, [sys.executable, *argv])
