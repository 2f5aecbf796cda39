"""The test node agent (tests/k8s/node_agent.py) as a `vllmServers` destination's pod selection
relies on (tests/e2e/test_vllm_e2e.py runs `vllm serve` pods so):
- readiness probes: a pod whose server is still starting is Running but not Ready, turns Ready once
  its httpGet probe passes, and leaves Ready when the probe fails failureThreshold times in a row;
- pod addresses: the replicas of a Deployment annotated for addresses of their own each get one
  and serve the same port on it, each its own server; a pod without the annotation has the
  node's address."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from controlplane import free_port
from helpers import condition, get_json, wait_for
from node_agent import NODE_IP, OWN_IP_ANNOTATION

pytestmark = pytest.mark.e2e

SERVER = textwrap.dedent(
    """
    import http.server, pathlib, sys, time
    flags, port = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    while not (flags / "serve").exists():  # a server still starting: nothing listens yet
        time.sleep(0.1)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and not (flags / "down").exists()
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(sys.argv[-1].encode())  # which server answered
        def log_message(self, *args):
            pass
    host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    http.server.HTTPServer((host, port), Health).serve_forever()
    """
)


def _pod(namespace: str, flags: Path, port: int) -> dict[str, Any]:
    container = {
        "name": "server",
        "image": "ignored",
        "command": [sys.executable, "-c", SERVER, str(flags), str(port)],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probed", "namespace": namespace},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 1},
    }


def _state(kubectl: Any, namespace: str) -> tuple[bool, bool, bool]:
    """(container running, container ready, pod Ready)."""
    pod = get_json(kubectl, "pod", "probed", "-n", namespace) or {}
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{"state": {}, "ready": False}]
    ready = condition(pod, "Ready")
    return (
        "running" in statuses[0]["state"],
        bool(statuses[0]["ready"]),
        bool(ready and ready["status"] == "True"),
    )


def test_pod_is_ready_only_while_its_http_probe_passes(kubectl: Any, node_agent: Any, namespace: str) -> None:
    flags = Path(node_agent.workdir) / f"{namespace}-flags"
    flags.mkdir()
    kubectl("apply", "-f", "-", input=json.dumps(_pod(namespace, flags, free_port())))
    wait_for("the container running", lambda: _state(kubectl, namespace)[0], 60)
    for _ in range(3):  # probes fail (nothing listens): running, never Ready
        assert _state(kubectl, namespace) == (True, False, False)
        time.sleep(1.0)
    (flags / "serve").touch()
    wait_for("Ready once the probe passes", lambda: _state(kubectl, namespace) == (True, True, True), 30)
    (flags / "down").touch()  # the server answers 503: unready after 2 failed probes, still running
    wait_for(
        "not Ready after failureThreshold", lambda: _state(kubectl, namespace) == (True, False, False), 30
    )
    (flags / "down").unlink()
    wait_for("Ready again", lambda: _state(kubectl, namespace) == (True, True, True), 30)


def _replicas(namespace: str, flags: Path, port: int) -> dict[str, Any]:
    """Two replicas serving `port`, each on its pod IP ($(POD_IP), the downward API)."""
    container = {
        "name": "server",
        "image": "ignored",
        "command": [sys.executable, "-c", SERVER, str(flags), str(port), "$(POD_IP)"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
    }
    labels = {"app": "own-ip"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "own-ip", "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {OWN_IP_ANNOTATION: "true"}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 1},
            },
        },
    }


def test_replicas_annotated_for_own_addresses_serve_one_port_each_on_its_own(
    kubectl: Any, node_agent: Any, namespace: str
) -> None:
    flags = Path(node_agent.workdir) / f"{namespace}-own-ip"
    flags.mkdir()
    (flags / "serve").touch()
    port = free_port()
    kubectl("apply", "-f", "-", input=json.dumps(_replicas(namespace, flags, port)))

    def ready_pods() -> list[dict[str, Any]] | None:
        pods = (get_json(kubectl, "pods", "-n", namespace, "-l", "app=own-ip") or {}).get("items") or []
        ready = [p for p in pods if (c := condition(p, "Ready")) is not None and c["status"] == "True"]
        return ready if len(ready) == 2 else None

    pods = wait_for("both replicas Ready", ready_pods, 60)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2 and NODE_IP not in ips, ips  # one address each, not the node's
    for ip in ips:  # each replica's own server answers on its address (the same port)
        assert httpx.get(f"http://{ip}:{port}/health", timeout=5).text == ip
    kubectl("apply", "-f", "-", input=json.dumps(_pod(namespace, flags, free_port())))  # the control
    wait_for("the plain pod Ready", lambda: _state(kubectl, namespace)[2], 60)
    plain = get_json(kubectl, "pod", "probed", "-n", namespace) or {}
    assert plain["status"]["podIP"] == NODE_IP
