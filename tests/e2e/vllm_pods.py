"""Kubernetes objects of tests/e2e/test_vllm_e2e.py: the WeightSync whose destination is
`vllm serve` pods selected by label, the Deployment of those pods (the server command and
environment the engine tests' servers use: sync_runtime/testing/vllm_server.py), and waiting
for the server pods' readiness probes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from helpers import condition, get_json, wait_for
from node_agent import OWN_IP_ANNOTATION

from sync_runtime.testing.vllm_server import serve_env
from sync_runtime.testing.vllm_server_nodes import DataParallelNode, command_args, node_args
from tests.support.eager import EAGER_HELPERS

SESSION_SITE = Path(__file__).resolve().parents[1] / "support" / "session_site"
NS = "ws-vllm"
WS = "policy"
SECRET = "ray-token"
RAY_NS = "e2e-vllm"
DEPLOYMENT = "rollout"
LABELS = {"app": "vllm-rollout"}
TP = 1
"""Each server's tensor parallelism (its world size, read through `/get_world_size`, must equal the
WeightSync's `tp`). The engine tests sync TP 2 servers (tests/engines/test_vllm_server*.py); here
the point is a Deployment of several pods, and two TP 1 servers start as many vLLM processes as
one TP 2 server (API server and engine core each, against API server, engine core, two workers)."""
REPLICAS = 2
"""The Deployment's pods: each one replica of the destination, ordered by pod name."""
DP_WS, DP_DEPLOYMENT, DP_LABELS, DP = "policy-dp", "rollout-dp", {"app": "vllm-rollout-dp"}, 3
"""The data-parallel server (`data_parallel_server`): three DP engines, three replicas, synced by
a WeightSync of its own that selects its head pod (DP_LABELS)."""
HEAD_ENGINES = 2
"""DP engines in the head pod (`--data-parallel-size-local`); the headless pod runs the rest."""
DP_NODE_DEPLOYMENT, NODE_LABELS = "rollout-dp-node", {"app": "vllm-rollout-dp-node"}
"""The data-parallel server's headless pod (DP ranks HEAD_ENGINES..): not selected by the WeightSync."""
MAX_MODEL_LEN = 512
"""The server's context: room for the long streamed requests of tests/e2e/vllm_client.py (the tiny
model's positions); a greedy row's bits do not depend on it."""
SERVER_READY_S = 600
"""The server pod's start (vLLM importing torch beside the sources and 0-2 oracle engines)."""


def manifest(address: str, port: int, version: str, *, dp: int = 1) -> dict[str, Any]:
    """No spec.model: the runtime reads the model config from the source actors. `dp` 2: the
    data-parallel server's WeightSync (its pod's two DP engines are the two replicas)."""
    name, deployment, labels = (WS, DEPLOYMENT, LABELS) if dp == 1 else (DP_WS, DP_DEPLOYMENT, DP_LABELS)
    servers: dict[str, Any] = {"selector": {"matchLabels": labels}, "port": port}
    if dp > 1:
        servers["dataParallelSize"] = dp
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": name, "namespace": NS},
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
                    "name": deployment,
                    "layout": "vllm",
                    "vllmServers": servers,
                    "pause": "keep",
                    # dp == 1: one replica a pod; else one a DP engine of the one server
                    "parallelism": {"tp": TP, "replicas": REPLICAS if dp == 1 else dp},
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
    """`vllm serve` pods as docs/vllm.md and examples/vllm-servers.yaml describe them (vLLM's own
    command: testing/vllm_cli.py), each listening on its pod IP. The node agent runs `command`
    with the engine env first on PATH (`python` is its interpreter) and gives each pod a loopback
    address of its own (the annotation), so that both replicas serve the same port as on a real
    node."""
    args = command_args(model_dir, port, tp=TP, max_model_len=MAX_MODEL_LEN)
    return _deployment(DEPLOYMENT, LABELS, REPLICAS, _container(args, port, local=1))


def data_parallel_server(model_dir: str, port: int, rpc_port: int) -> dict[str, Any]:
    """A data-parallel server whose engines span two pods, as a multi-node deployment runs it
    (docs/vllm.md, "Servers over several nodes"): the head pod (DP ranks 0 and 1 and the HTTP
    server, one API server, DP_LABELS: what the WeightSync selects) and a headless pod (DP rank 2,
    its engine only, NODE_LABELS), each of vLLM's own `vllm serve` (testing/vllm_server_nodes.py):
    a server with several engines in one pod and one over several pods at once. The headless pod
    finds the head at 127.0.0.1, the address every pod of the node agent shares (a
    LeaderWorkerSet hands its workers the leader's address instead). A List of two Deployments."""
    nodes = (
        (DP_DEPLOYMENT, DP_LABELS, DataParallelNode(0, HEAD_ENGINES, rpc_port)),
        (DP_NODE_DEPLOYMENT, NODE_LABELS, DataParallelNode(HEAD_ENGINES, DP - HEAD_ENGINES, rpc_port)),
    )
    pods = []
    for name, labels, node in nodes:
        args = node_args(model_dir, port, node, dp=DP, tp=TP, api_servers=1, max_model_len=MAX_MODEL_LEN)
        container = _container(args, None if node.start_rank else port, local=node.local)
        pods.append(_deployment(name, labels, 1, container))
    return {"apiVersion": "v1", "kind": "List", "items": pods}


def _container(args: list[str], port: int | None, *, local: int) -> dict[str, Any]:
    """The server container: `args` after the interpreter, listening on the pod's IP; `port`
    None: a headless node (no HTTP, no readiness probe: Ready while it runs)."""
    # The engine settings of the tests' servers; not their PYTHONPATH: the plugin comes from the
    # installed package, as in a user's image. On it only the test session's site settings
    # (tests/support/session_site: a pod serving a steady client would otherwise spin both cores).
    env = {k: v for k, v in serve_env(TP, local).items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(SESSION_SITE)
    env.update(EAGER_HELPERS)  # as the session's own engines and the oracle: tests/support/eager.py
    env["VLLM_CACHE_ROOT"] = _session_vllm_cache()
    if ipc := os.environ.get("VLLM_RPC_BASE_PATH"):  # the session's socket folder (tests/conftest.py)
        env["VLLM_RPC_BASE_PATH"] = ipc
    container: dict[str, Any] = {
        "name": "vllm",
        "image": "unused",  # the node agent runs the command as a local process
        "command": ["python", *_on_pod_ip(args)],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *({"name": k, "value": v} for k, v in sorted(env.items())),
        ],
    }
    if port is not None:
        container["ports"] = [{"name": "http", "containerPort": port}]
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2}
    return container


def _deployment(
    name: str, labels: dict[str, str], replicas: int, container: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {OWN_IP_ANNOTATION: "true"}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 3},
            },
        },
    }


def _session_vllm_cache() -> str:
    """vLLM's cache folder of the test session, for the pods too: vLLM's default, as `vllm.envs`
    computes it (not imported here: 3 CPU-seconds of vLLM's imports in a test process that
    otherwise has none). The node agent gives each pod a HOME of its own, where vLLM's cache of what
    it learnt about a model class (`modelinfos`, keyed by the hash of the model's source file)
    starts empty: each server would inspect its class once more in a subprocess that imports vLLM
    (measured with process accounting: about 10 CPU-seconds a pod)."""
    if root := os.environ.get("VLLM_CACHE_ROOT"):
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")


def _on_pod_ip(args: list[str]) -> list[str]:
    """The server's arguments listening on the pod's address instead of 127.0.0.1."""
    assert "--host=127.0.0.1" in args, args
    return ["--host=$(POD_IP)" if a == "--host=127.0.0.1" else a for a in args]


def server_pods(kubectl: Any, labels: dict[str, str] = LABELS) -> list[dict[str, Any]]:
    """The Deployment's pods, ordered by name (the replicas' order)."""
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = (get_json(kubectl, "pods", "-n", NS, "-l", selector) or {}).get("items") or []
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def wait_server_ready(kubectl: Any) -> tuple[list[dict[str, Any]], int]:
    """The server pods once all are Ready, and how often one was seen running but not Ready."""
    unready = 0

    def ready() -> list[dict[str, Any]] | None:
        nonlocal unready
        pods, ready = server_pods(kubectl), []
        for pod in pods:
            found = condition(pod, "Ready")
            if found is not None and found["status"] == "True":
                ready.append(pod)
                continue
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            unready += any("running" in s["state"] for s in statuses)
        return ready if len(ready) == REPLICAS else None

    return wait_for("the vllm serve pods Ready", ready, SERVER_READY_S, interval=1.0), unready


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
