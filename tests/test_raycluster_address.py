"""`rayCluster: NAME` -> the GCS address of a KubeRay RayCluster, from the object alone."""

from __future__ import annotations

from typing import Any

import pytest

from sync_runtime.errors import (
    RayClusterNotFoundError,
    RayClusterNotReadyError,
    RayUnreachableError,
    Reason,
    WeightSyncError,
)
from sync_runtime.schema.crd import DeploymentRef, raycluster_gcs_address, resolve_ray_address

pytestmark = pytest.mark.unit


def cluster(head: dict[str, Any] | None = None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "rl"}}
    obj["spec"] = {"headGroupSpec": {"rayStartParams": params or {}}}
    if head is not None:
        obj["status"] = {"head": head}
    return obj


def test_pod_ip_and_default_port() -> None:
    assert raycluster_gcs_address(cluster({"podIP": "10.1.2.3"}), "rl", "ns") == "10.1.2.3:6379"


def test_pod_ip_preferred_over_service_ip() -> None:
    head = {"podIP": "10.1.2.3", "serviceIP": "172.20.0.9"}
    assert raycluster_gcs_address(cluster(head), "rl", "ns") == "10.1.2.3:6379"


def test_service_ip_when_no_pod_ip() -> None:
    head = {"podIP": "", "serviceIP": "172.20.0.9"}
    assert raycluster_gcs_address(cluster(head, {"port": "6380"}), "rl", "ns") == "172.20.0.9:6380"


def test_port_from_ray_start_params_string_or_int() -> None:
    assert raycluster_gcs_address(cluster({"podIP": "h"}, {"port": "41234"}), "rl", "ns") == "h:41234"
    assert raycluster_gcs_address(cluster({"podIP": "h"}, {"port": 41235}), "rl", "ns") == "h:41235"


def test_missing_cluster_is_not_found_with_its_reason() -> None:
    with pytest.raises(RayClusterNotFoundError, match="RayCluster team/nope not found") as e:
        raycluster_gcs_address(None, "nope", "team")
    assert e.value.to_failure().reason == Reason.RAY_CLUSTER_NOT_FOUND == "RayClusterNotFound"
    assert isinstance(e.value, RayUnreachableError)  # the runtime's connect loop retries it


@pytest.mark.parametrize("obj", [cluster(), cluster({}), cluster({"podIP": "", "serviceIP": ""})])
def test_no_head_address_is_not_ready(obj: dict[str, Any]) -> None:
    with pytest.raises(RayClusterNotReadyError, match="no head address") as e:
        raycluster_gcs_address(obj, "rl", "ns")
    assert e.value.to_failure().reason == "RayClusterNotReady"


@pytest.mark.parametrize("port", ["0", "65536", "gcs", "-1", ""])
def test_bad_port_is_not_ready(port: str) -> None:
    with pytest.raises(RayClusterNotReadyError, match="is not a TCP port"):
        raycluster_gcs_address(cluster({"podIP": "h"}, {"port": port}), "rl", "ns")


def test_resolve_reads_the_named_cluster_in_the_weightsyncs_namespace() -> None:
    ref = DeploymentRef(name="rollout", ray_cluster="rl", actor_prefix="v-", layout="vllm")
    calls: list[tuple[str, str]] = []

    def read(namespace: str, name: str) -> dict[str, Any] | None:
        calls.append((namespace, name))
        return cluster({"podIP": "10.9.9.9"}, {"port": "7000"}) if name == "rl" else None

    assert resolve_ray_address(ref, "team", read) == "10.9.9.9:7000"
    assert calls == [("team", "rl")]
    other = DeploymentRef(name="rollout", ray_cluster="other", actor_prefix="v-", layout="vllm")
    with pytest.raises(RayClusterNotFoundError):
        resolve_ray_address(other, "team", read)


def test_resolve_without_kubernetes_is_one_line() -> None:
    ref = DeploymentRef(name="rollout", ray_cluster="rl", actor_prefix="v-", layout="vllm")
    with pytest.raises(WeightSyncError, match="needs the Kubernetes API"):
        resolve_ray_address(ref, "team")


def test_ray_address_needs_no_lookup() -> None:
    ref = DeploymentRef(name="t", ray_address="10.0.0.1:6379", actor_prefix="t-", layout="megatron")
    assert resolve_ray_address(ref, "ns") == "10.0.0.1:6379"
