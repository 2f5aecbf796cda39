"""Kubernetes objects of tests/e2e/test_vllm_e2e.py: the WeightSync whose destination is
`vllm serve` pods selected by label, the Deployment of those pods (the server command and
environment the engine tests' servers use: sync_runtime/testing/vllm_server.py), and waiting
for the server pod's readiness probe."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from helpers import condition, get_json, wait_for

from sync_runtime.testing.vllm_server import serve_args, serve_env

QUIET_VLLM = Path(__file__).resolve().parents[1] / "support" / "quiet_vllm"
NS = "ws-vllm"
WS = "policy"
SECRET = "ray-token"
RAY_NS = "e2e-vllm"
DEPLOYMENT = "rollout"
LABELS = {"app": "vllm-rollout"}
TP = 2
"""The server's tensor parallelism: two workers in the pod, each one destination rank of the sync
(the pod's world size, read through `/get_world_size`, must equal the WeightSync's `tp`)."""
MAX_MODEL_LEN = 512
"""The server's context: room for the long streamed requests of tests/e2e/vllm_client.py (the tiny
model's positions); a greedy row's bits do not depend on it."""
SERVER_READY_S = 600
"""The server pod's start (vLLM importing torch beside the sources and 0-2 oracle engines)."""


def manifest(address: str, port: int, version: str) -> dict[str, Any]:
    """No spec.model: the runtime reads the model config from the source actors."""
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": WS, "namespace": NS},
        "spec": {
            "version": version,
            "source": {
                "name": "trainer",
                "rayAddress": address,
                "rayNamespace": RAY_NS,
                "actorPrefix": "trainer-",
                "layout": "megatron",
                "parallelism": {"tp": 2},
                "authSecretRef": {"name": SECRET, "key": "auth_token"},
            },
            "destinations": [
                {
                    "name": DEPLOYMENT,
                    "layout": "vllm",
                    "vllmServers": {"selector": {"matchLabels": LABELS}, "port": port},
                    "pause": "keep",
                    "parallelism": {"tp": TP, "replicas": 1},
                }
            ],
            "transport": {
                "bucketMb": 1,
                "stagingBudgetMb": 8,
                "connectTimeoutSeconds": 60,
                "transferTimeoutSeconds": 60,
            },
            "retry": {"limit": 2, "backoffSeconds": 1, "maxBackoffSeconds": 5},
        },
    }


def deployment(model_dir: str, port: int) -> dict[str, Any]:
    """`vllm serve` pods as docs/vllm.md and examples/vllm-servers.yaml describe them. The node
    agent runs `command` with the engine env first on PATH (`python` is its interpreter)."""
    # The engine settings of the tests' servers; not their PYTHONPATH: the plugin comes from the
    # installed package, as in a user's image. On it only the test session's quiet vLLM readers
    # (tests/support/quiet_vllm: a pod serving a steady client would otherwise spin both cores).
    env = {k: v for k, v in serve_env(TP).items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(QUIET_VLLM)
    container = {
        "name": "vllm",
        "image": "unused",  # the node agent runs the command as a local process
        "command": ["python", *serve_args(model_dir, port, tp=TP, max_model_len=MAX_MODEL_LEN)],
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "namespace": NS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 3},
            },
        },
    }


def server_pods(kubectl: Any) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in LABELS.items())
    return list((get_json(kubectl, "pods", "-n", NS, "-l", selector) or {}).get("items") or [])


def wait_server_ready(kubectl: Any) -> tuple[dict[str, Any], int]:
    """The server pod once Ready, and how often it was seen running but not Ready before."""
    unready = 0

    def ready() -> dict[str, Any] | None:
        nonlocal unready
        for pod in server_pods(kubectl):
            found = condition(pod, "Ready")
            if found is not None and found["status"] == "True":
                return pod
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            unready += any("running" in s["state"] for s in statuses)
        return None

    return wait_for("the vllm serve pod Ready", ready, SERVER_READY_S, interval=1.0), unready


class ReadyWatch(threading.Thread):
    """`wait_server_ready` in the background (a daemon: a failed setup does not wait for it)."""

    def __init__(self, kubectl: Any) -> None:
        super().__init__(daemon=True)
        self.kubectl = kubectl
        self.unready, self.ready_at = 0, 0.0
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            _, self.unready = wait_server_ready(self.kubectl)
            self.ready_at = time.monotonic()
        except BaseException as e:  # re-raised by result()
            self.error = e

    def result(self) -> tuple[int, float]:
        """(times seen running but not Ready, time.monotonic() when seen Ready)."""
        self.join(SERVER_READY_S + 60)
        if self.error is not None:
            raise self.error
        assert self.ready_at, "the readiness watch did not finish"
        return self.unready, self.ready_at
