"""Reading the KubeRay RayCluster a `rayCluster:` deployment names (the runtime Role's `get`).

The address is derived from the object by the pure `crd.raycluster_gcs_address`; this module only
fetches it. A 404 means no such RayCluster (or no KubeRay CRD at all) and returns None; any other
API failure is one line in a `RayUnreachableError`, so the runtime reports it and retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sync_runtime.errors import RayUnreachableError
from sync_runtime.kube.client import load_config
from sync_runtime.schema.crd import RAYCLUSTER_GROUP, RAYCLUSTER_PLURAL, RAYCLUSTER_VERSION


def _custom_api() -> Any:
    from kubernetes import client

    load_config(lambda e: RayUnreachableError(f"rayCluster needs the Kubernetes API: {e}"))
    return client.CustomObjectsApi()


def read_raycluster(namespace: str, name: str, api: Any = None) -> Mapping[str, Any] | None:
    """The RayCluster `ray.io/v1` `name` in `namespace`, or None when it does not exist."""
    from kubernetes.client.rest import ApiException

    api = api or _custom_api()
    try:
        obj = api.get_namespaced_custom_object(
            RAYCLUSTER_GROUP, RAYCLUSTER_VERSION, namespace, RAYCLUSTER_PLURAL, name
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise RayUnreachableError(
            f"cannot read RayCluster {namespace}/{name}: HTTP {e.status} {e.reason}"
            + (" (the runtime's Role needs get on rayclusters.ray.io)" if e.status == 403 else "")
        ) from e
    return obj if isinstance(obj, Mapping) else None
