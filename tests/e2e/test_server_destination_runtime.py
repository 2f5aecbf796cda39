"""A vllmServers destination through the whole control plane, before any vLLM is involved.

kube-apiserver and controllers, helm (the chart: its runtime Role with `list pods`), `kopf run`,
the runtime pod's `weightsync run --kubernetes` (run by the node agent as a local process, with
its in-cluster identity) and Ray with token auth are all real; the WeightSync's destination names
server pods by label. What the runtime pod must do with them is checked where it shows, in the
CR's status:

1. no pod matches: the sync fails at discovery, reason DiscoveryFailed, the message naming the
   selector and the replicas expected (nothing attached, no byte moved);
2. a matching pod runs (a process that serves nothing on the port): the runtime lists it through
   the API with its own token, and the next sync fails naming that pod and the route it could
   not reach, before any byte moves.

Real `vllm serve` pods are in the engine environment's tests: tests/e2e/test_vllm_e2e.py (a
Deployment of them through this same control plane, synced while it serves) and
tests/engines/test_vllm_server_pause.py (the same attacher against a real server).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import free_port
from helpers import condition, dump_pod_logs, get_json, operator_values, wait_for
from ray_cluster import RayCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CHART = Path(__file__).resolve().parents[2] / "charts" / "weightsync-operator"
NS = "ws-servers"
RELEASE = "wso-servers"
WS = "policy"
SECRET = "ray-token"
LABELS = {"app": "vllm-e2e"}
SYNC_TIMEOUT = 240
"""A fresh runtime pod on a loaded 2-core machine imports torch and joins Ray first."""


@pytest.fixture(scope="module")
def release(
    node_agent: Any,
    kubectl: Any,
    helm: Any,
    ray_cluster: RayCluster,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("servers-e2e")
    failed_before = request.session.testsfailed
    installed = False
    try:
        kubectl("create", "namespace", NS)
        wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", NS), 30)
        kubectl(
            "create", "secret", "generic", SECRET, "-n", NS, f"--from-literal=auth_token={ray_cluster.token}"
        )
        (work / "values.yaml").write_text(yaml.safe_dump(operator_values(NS, free_port())))
        helm(
            "install", RELEASE, str(CHART), "-n", NS, "-f", str(work / "values.yaml"),
            "--wait", "--timeout", "3m", timeout=240,
        )  # fmt: skip
        installed = True
        yield {"address": ray_cluster.address, "port": free_port()}
    finally:
        if request.session.testsfailed > failed_before:
            dump_pod_logs(node_agent.workdir / "pods", NS)
        kubectl(
            "delete",
            "weightsync",
            WS,
            "-n",
            NS,
            "--ignore-not-found",
            "--timeout=60s",
            check=False,
            timeout=90,
        )
        if installed:
            helm("uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=120)
        kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _manifest(address: str, port: int, version: str) -> dict[str, Any]:
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": WS, "namespace": NS},
        "spec": {
            "version": version,
            "model": "tiny-llama",
            "source": {
                "name": "trainer",
                "rayAddress": address,
                "rayNamespace": "servers-e2e",
                "actorPrefix": "trainer-",
                "layout": "megatron",
                "authSecretRef": {"name": SECRET, "key": "auth_token"},
            },
            "destinations": [
                {
                    "name": "rollout",
                    "layout": "vllm",
                    "vllmServers": {"selector": {"matchLabels": LABELS}, "port": port},
                    "pause": "wait",
                }
            ],
            "retry": {"limit": 0, "backoffSeconds": 1, "maxBackoffSeconds": 1},
        },
    }


def _failed(kubectl: Any, version: str, needle: str) -> dict[str, Any]:
    """The WeightSync once the last sync of `version` failed with `needle` in its message."""

    def check() -> Any:
        obj = get_json(kubectl, "weightsync", WS, "-n", NS) or {}
        last = (obj.get("status") or {}).get("lastSync") or {}
        failure = last.get("failure") or {}
        if last.get("version") == version and needle in failure.get("message", ""):
            return obj
        return None

    return wait_for(f"sync {version} failing with {needle!r}", check, SYNC_TIMEOUT, interval=1.0)  # type: ignore[no-any-return]


def test_no_matching_pod_fails_discovery_naming_the_selector(release: dict[str, Any], kubectl: Any) -> None:
    kubectl("apply", "-f", "-", input=json.dumps(_manifest(release["address"], release["port"], "v1")))
    obj = _failed(kubectl, "v1", "0 Ready vLLM server pod(s) match 'app=vllm-e2e'")
    last = obj["status"]["lastSync"]
    assert last["failure"]["reason"] == "DiscoveryFailed" and last["failure"]["step"] == "discover", last
    assert "expected replicas=1" in last["failure"]["message"] and last["movedBytes"] == 0, last
    synced = condition(obj, "Synced")
    assert synced is not None and synced["status"] == "False" and synced["reason"] == "DiscoveryFailed", (
        synced
    )


def test_a_matching_pod_is_listed_by_the_runtime_and_named(release: dict[str, Any], kubectl: Any) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "srv-0", "namespace": NS, "labels": LABELS},
        "spec": {
            # The node agent runs the command as a local process (pod IP 127.0.0.1): it listens on
            # nothing, so the runtime reaches the pod through the API but not its vLLM routes.
            "containers": [
                {
                    "name": "vllm",
                    "image": "unused",
                    "command": [sys.executable, "-c", "import time; time.sleep(900)"],
                }
            ],
            "terminationGracePeriodSeconds": 1,
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(pod))

    def ready() -> bool:
        found = condition(get_json(kubectl, "pod", "srv-0", "-n", NS), "Ready")
        return found is not None and found["status"] == "True"

    wait_for("srv-0 Ready", ready, 60)
    patch = {"spec": {"version": "v2"}}
    kubectl("patch", "weightsync", WS, "-n", NS, "--type=merge", "-p", json.dumps(patch))
    obj = _failed(kubectl, "v2", "vLLM server pod srv-0 (http://127.0.0.1:")
    failure = obj["status"]["lastSync"]["failure"]
    assert failure["reason"] == "DiscoveryFailed" and "/get_world_size" in failure["message"], failure
    assert obj["status"]["lastSync"]["movedBytes"] == 0
