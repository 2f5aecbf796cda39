"""Small helpers shared by the end-to-end tests: waiting, reading objects through kubectl."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

Kubectl = Callable[..., Any]


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
