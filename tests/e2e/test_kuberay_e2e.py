"""`rayCluster: NAME` end to end: KubeRay's own RayCluster CRD, the real operator and runtime pod.

KubeRay's CRD (`ray.io_rayclusters.yaml` from its published Go module, cached by
`tests/k8s/ensure_kuberay_crd.sh`) is installed into the test control plane. A RayCluster object
named as in `examples/weightsync.yaml` stands for the suite's Ray head: its status says the head
pod is at 127.0.0.1 and its `rayStartParams.port` is the head's GCS port (no KubeRay operator
runs; the status is written through the status subresource as KubeRay would). The WeightSync is
the example, keeping its `rayCluster:` form: the runtime pod reads the RayCluster with its own
ServiceAccount (the chart's Role) and joins the GCS as a driver.

Order matters (file order): first the negative controls (no such cluster; a cluster with no head
address yet), while the destinations still hold the stale v0; then the head address appears and
the same WeightSync syncs v1, bit-exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import free_port
from helpers import condition, dump_pod_logs, get_json, operator_values, runtime_pods, wait_for
from ray_cluster import RayCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weightsync-operator"
EXAMPLE = REPO / "examples" / "weightsync.yaml"
ENSURE_CRD = REPO / "tests" / "k8s" / "ensure_kuberay_crd.sh"
NS = "ws-kuberay"
RELEASE = "wsk"
SECRET = "ray-token"
WS, GHOST = "policy", "ghost"
# The point here is how the runtime finds the cluster, not the layout: one rank per side (each
# rank is a Ray worker importing torch; the e2e WeightSync module covers tp=2 -> tp=2 x2).
MODEL, SRC, DST = "tiny-llama", "tp=1", "tp=1"
SRC_PARALLELISM, DST_PARALLELISM = {"tp": 1}, {"tp": 1}
RAY_NS = "e2e-kuberay"
SRC_PREFIX, DST_PREFIX = "kr-trainer-", "kr-vllm-"
SEED = 23
SYNC_TIMEOUT = 240


def _example_cluster_name() -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    names = {ref["rayCluster"] for ref in [doc["spec"]["source"], *doc["spec"]["destinations"]]}
    assert len(names) == 1, names
    return str(names.pop())


CLUSTER = _example_cluster_name()


SETUP = [
    "--namespace", RAY_NS, "--model", MODEL, "--src", SRC, "--dst", DST, "--seed", str(SEED),
    "--src-prefix", SRC_PREFIX, "--dst-prefix", DST_PREFIX,
]  # fmt: skip
"""The demo's participants here, for the suite's Ray driver (tests/e2e/ray_driver.py)."""


def _holds(ray_cluster: RayCluster, version: str) -> bool:
    """Whether every destination rank holds `version` bit-exact (the demo's independent check)."""
    return not ray_cluster.driver("verify", *SETUP, "--version", version)["problems"]


@pytest.fixture(scope="module")
def participants(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """Sources at v1, destinations at the stale v0, in the suite's Ray cluster."""
    ray_cluster.driver("participants", *SETUP, "--version", "v1", "--stale-version", "v0", timeout=300)
    yield ray_cluster
    ray_cluster.driver("kill-all", "--namespace", RAY_NS)  # detached: they would outlive the module


@pytest.fixture(scope="module")
def kuberay_crd(control_plane: Any, kubectl: Any) -> str:
    """KubeRay's RayCluster CRD in the control plane (created once; kept for the session)."""
    proc = subprocess.run(["bash", str(ENSURE_CRD)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip().splitlines()[-1]
    if get_json(kubectl, "crd", "rayclusters.ray.io") is None:
        # `create`, not client-side `apply`: the CRD (~850 kB) exceeds the last-applied annotation.
        kubectl("create", "-f", path)

    def established() -> bool:
        crd = get_json(kubectl, "customresourcedefinitions.apiextensions.k8s.io", "rayclusters.ray.io")
        return (condition(crd, "Established") or {}).get("status") == "True"

    wait_for("KubeRay's RayCluster CRD Established", established, 60)
    # ...and served: the first `kubectl get` of a new kind may race API discovery.
    wait_for(
        "rayclusters.ray.io served",
        lambda: kubectl("get", "rayclusters.ray.io", "-A", check=False).returncode == 0,
        60,
    )
    return path


@pytest.fixture(scope="module")
def release(
    kuberay_crd: str,
    node_agent: Any,
    kubectl: Any,
    helm: Any,
    ray_cluster: RayCluster,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[None]:
    kubectl("create", "namespace", NS)
    wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", NS), 30)
    kubectl("create", "secret", "generic", SECRET, "-n", NS, f"--from-literal=auth_token={ray_cluster.token}")
    path = tmp_path_factory.mktemp("helm") / "values.yaml"
    path.write_text(yaml.safe_dump(operator_values(NS, free_port())))
    helm("install", RELEASE, str(CHART), "-n", NS, "-f", str(path), "--wait", "--timeout", "3m", timeout=240)
    failed_before = request.session.testsfailed
    try:
        yield
    finally:
        if request.session.testsfailed > failed_before:
            dump_pod_logs(node_agent.workdir / "pods", NS)
        helm("uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=120)
        kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _apply(kubectl: Any, tmp_path: Path, doc: dict[str, Any]) -> None:
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    kubectl("apply", "-f", str(path))


def _ray_cluster_object(gcs_port: int) -> dict[str, Any]:
    """A RayCluster as a user writes it; KubeRay's CRD requires the head's pod template."""
    container = {"name": "ray-head", "image": "rayproject/ray:2.54.0"}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": CLUSTER, "namespace": NS},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"port": str(gcs_port)},
                "template": {"spec": {"containers": [container]}},
            }
        },
    }


def _weightsync(name: str, cluster: str) -> dict[str, Any]:
    """examples/weightsync.yaml with its rayCluster form kept, pointed at the demo's participants."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    spec = doc["spec"]
    spec["version"], spec["model"] = "v1", MODEL

    def point(ref: dict[str, Any], prefix: str, parallelism: dict[str, int]) -> dict[str, Any]:
        assert "rayCluster" in ref and "rayAddress" not in ref, ref
        return {
            **ref,
            "rayCluster": cluster,
            "rayNamespace": RAY_NS,
            "actorPrefix": prefix,
            "parallelism": parallelism,
            "authSecretRef": {"name": SECRET, "key": "auth_token"},
        }

    spec["source"] = point(spec["source"], SRC_PREFIX, SRC_PARALLELISM)
    spec["destinations"] = [point(spec["destinations"][0], DST_PREFIX, DST_PARALLELISM)]
    spec["transport"].update(
        bucketMb=1, stagingBudgetMb=8, connectTimeoutSeconds=60, transferTimeoutSeconds=60
    )
    spec["retry"] = {"limit": 3, "backoffSeconds": 1, "maxBackoffSeconds": 3}
    spec.pop("runtime", None)  # resource requests mean nothing to the node agent
    return doc


def _wait_reason(kubectl: Any, name: str, reason: str, timeout: float = SYNC_TIMEOUT) -> dict[str, Any]:
    """Until a condition of WeightSync `name` carries `reason`; returns that condition."""

    def found() -> Any:
        obj = get_json(kubectl, "weightsync", name, "-n", NS) or {}
        hits = [c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("reason") == reason]
        return hits[0] if hits else None

    try:
        return wait_for(f"{name}: a condition with reason {reason}", found, timeout)  # type: ignore[no-any-return]
    except AssertionError as e:
        status = (get_json(kubectl, "weightsync", name, "-n", NS) or {}).get("status")
        raise AssertionError(f"{e}; status: {json.dumps(status)[-3000:]}") from None


def _assert_nothing_synced(kubectl: Any, name: str, participants: RayCluster) -> None:
    status = (get_json(kubectl, "weightsync", name, "-n", NS) or {}).get("status") or {}
    assert not status.get("syncedVersion") and not status.get("lastSync"), status
    assert (condition({"status": status}, "Synced") or {}).get("status") != "True", status
    assert not _holds(participants, "v1"), "destinations changed although no RayCluster was resolved"


def test_unknown_ray_cluster_is_reported_and_nothing_synced(
    release: None, participants: RayCluster, kubectl: Any, tmp_path: Path
) -> None:
    _apply(kubectl, tmp_path, _weightsync(GHOST, "no-such-cluster"))
    cond = _wait_reason(kubectl, GHOST, "RayClusterNotFound")
    assert cond["status"] == "False" and "no-such-cluster" in cond["message"], cond
    assert f"RayCluster {NS}/no-such-cluster not found" in cond["message"], cond
    _assert_nothing_synced(kubectl, GHOST, participants)
    kubectl("delete", "weightsync", GHOST, "-n", NS, "--wait=true", "--timeout=60s", timeout=90)


def test_ray_cluster_without_head_address_is_not_ready(
    release: None, participants: RayCluster, kubectl: Any, tmp_path: Path
) -> None:
    """The RayCluster exists but KubeRay has not reported its head yet: RayClusterNotReady."""
    gcs_port = int(participants.address.rsplit(":", 1)[1])
    _apply(kubectl, tmp_path, _ray_cluster_object(gcs_port))
    _apply(kubectl, tmp_path, _weightsync(WS, CLUSTER))
    cond = _wait_reason(kubectl, WS, "RayClusterNotReady")
    assert "no head address" in cond["message"], cond
    _assert_nothing_synced(kubectl, WS, participants)


def test_ray_cluster_name_syncs_through_its_head(
    release: None, participants: RayCluster, kubectl: Any
) -> None:
    """status.head.podIP appears (as KubeRay writes it): the waiting runtime resolves it and syncs."""
    patch = {"status": {"head": {"podIP": "127.0.0.1", "serviceIP": "10.96.0.77"}}}
    kubectl(
        "patch",
        "raycluster",
        CLUSTER,
        "-n",
        NS,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )
    rc = get_json(kubectl, "raycluster", CLUSTER, "-n", NS)
    assert rc["status"]["head"]["podIP"] == "127.0.0.1", rc.get("status")
    t0 = time.monotonic()
    kubectl(
        "wait",
        f"weightsync/{WS}",
        "-n",
        NS,
        "--for=jsonpath={.status.syncedVersion}=v1",
        f"--timeout={SYNC_TIMEOUT}s",
        timeout=SYNC_TIMEOUT + 30,
    )
    kubectl("wait", f"weightsync/{WS}", "-n", NS, "--for=condition=Synced", "--timeout=60s", timeout=90)
    print(f"rayCluster sync after the head address appeared: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    obj = get_json(kubectl, "weightsync", WS, "-n", NS)
    status = obj["status"]
    assert status["phase"] == "Synced" and status["syncedVersion"] == "v1", status
    assert status["lastSync"]["result"] == "Succeeded" and status["lastSync"]["movedBytes"] > 0, status
    assert (condition(obj, "RuntimeReady") or {}).get("status") == "True", status
    assert _holds(participants, "v1"), "destinations do not hold v1 bit-exact"
    # One runtime pod served it: the one that waited for the head address, not a replacement.
    live = [p for p in runtime_pods(kubectl, NS, WS) if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 1, [p["metadata"]["name"] for p in live]
