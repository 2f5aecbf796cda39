"""Small helpers shared by the end-to-end tests: waiting, reading objects through kubectl, the
chart values of a test release, printing past pytest's capture."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

Kubectl = Callable[..., Any]


def say(config: pytest.Config, line: str) -> None:
    """Print past pytest's output capture (startup times and phase timings show up even with -q)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if capman is None or tr is None:
        print(line)
        return
    with capman.global_and_fixture_disabled():
        tr.write_line(line)


def operator_values(namespace: str, metrics_port: int, **operator: Any) -> dict[str, Any]:
    """Chart values of a test release: single-namespace mode, the node agent's loopback, no probes."""
    return {
        "watchNamespace": namespace,
        # The node agent puts the venv's bin first on PATH: `kopf` is the real kopf CLI.
        "operator": {"command": ["kopf"], "healthPort": 0, "reconcileIntervalSeconds": 1, **operator},
        "bindAddress": "127.0.0.1",  # nothing in the test listens off loopback
        "metrics": {"port": metrics_port},
    }


def dump_pod_logs(pods_dir: Path, namespace: str, tail: int = 60) -> None:
    """The last lines of every pod the node agent ran in `namespace` (operator, runtimes), to stderr."""
    noise = ("Timer 'tick' succeeded", "Handler 'on_event' succeeded")
    for log in sorted(pods_dir.glob(f"{namespace}_*/logs/*.log"), key=lambda p: p.stat().st_mtime):
        lines = [x for x in log.read_text(errors="replace").splitlines() if not any(n in x for n in noise)]
        lines = lines[-tail:]
        print(f"----- {log.parent.parent.name}/{log.name} (last {len(lines)} lines)", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60, interval: float = 0.5) -> Any:
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def get_json(kubectl: Kubectl, *args: str) -> Any:
    """``kubectl get ARGS -o json`` (None when not found)."""
    proc = kubectl("get", *args, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return None
        raise AssertionError(f"kubectl get {' '.join(args)}: {proc.stderr}")
    return json.loads(proc.stdout)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return None


def runtime_pods(kubectl: Kubectl, namespace: str, ws_name: str) -> list[dict[str, Any]]:
    """The runtime pods of WeightSync ``ws_name`` (by the operator's labels), terminating ones included."""
    items = get_json(
        kubectl,
        "pods",
        "-n",
        namespace,
        "-l",
        f"app.kubernetes.io/name=weightsync-runtime,weightsync.io/name={ws_name}",
    )
    return list((items or {}).get("items") or [])


def events_for(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    items = get_json(kubectl, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    return list((items or {}).get("items") or [])


def container_argv(pod: dict[str, Any]) -> list[str]:
    """argv of the local process the node agent runs for the pod's first container."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    raw = Path(f"/proc/{int(cid.removeprefix('local://'))}/cmdline").read_bytes()
    # The agent runs `unshare ... sh -c SCRIPT sh EXE ARGS`: the container's argv follows "sh".
    return [a.decode() for a in raw.split(b"\0") if a]
