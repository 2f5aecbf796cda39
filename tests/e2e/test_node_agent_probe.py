"""The test node agent's readiness probes (tests/k8s/node_agent.py): a pod whose server is still
starting is Running but not Ready, turns Ready once its httpGet probe passes, and leaves Ready
when the probe fails failureThreshold times in a row (what a `vllmServers` destination's pod
selection relies on: tests/e2e/test_vllm_e2e.py runs `vllm serve` pods so)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from controlplane import free_port
from helpers import condition, get_json, wait_for

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
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
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
