"""The pause mode of a `vllmServers` destination reaches a proxy the attacher keeps across syncs.

The runtime pod keeps one proxy per server process for as long as the process lives
(engines/vllm_servers.py), while the spec it syncs may change between syncs: a `kubectl patch` of
`destinations[].pause` must reach that proxy, not only a proxy attached after it, and the
operator keeps the runtime pod for it (it is not part of the pod's topology hash). The proxy here is
a stand-in with the proxy's method (no Ray, no server); the real proxy and server are in
tests/e2e/test_vllm_e2e.py, whose syncs change the mode through the same runtime pod.
"""

from __future__ import annotations

from typing import Any

import pytest
from weightsync_operator.pod import topology_hash

from sync_runtime.engines import vllm_ranks, vllm_servers
from sync_runtime.engines.vllm_servers import ServerAttacher
from sync_runtime.errors import DestinationError
from sync_runtime.kube.pods import ServerPod
from sync_runtime.schema.crd import DeploymentRef, LabelSelector, VllmServers, WeightSyncSpec

pytestmark = pytest.mark.unit


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return lambda: self.fn(*args)  # run by the patched ray.get


class StandInProxy:
    """What the attacher calls on a kept proxy: its liveness and its pause mode."""

    def __init__(self, mode: str) -> None:
        self.modes = [mode]
        self.ws_num_ranks = _Call(lambda: 1)
        self.ws_set_pause_mode = _Call(self.modes.append)


def ref(pause: str | None) -> DeploymentRef:
    servers = VllmServers(selector=LabelSelector(match_labels={"app": "vllm"}), port=8000)
    return DeploymentRef(name="rollout", layout="vllm", vllm_servers=servers, pause=pause)


def spec_with(pause: str | None, port: int = 8000) -> WeightSyncSpec:
    servers = {"selector": {"matchLabels": {"app": "vllm"}}, "port": port}
    destination = {"name": "rollout", "layout": "vllm", "vllmServers": servers, "pause": pause}
    return WeightSyncSpec.model_validate(
        {
            "version": "v1",
            "source": {"name": "t", "rayAddress": "10.0.0.1:6379", "actorPrefix": "t-", "layout": "megatron"},
            "destinations": [{k: v for k, v in destination.items() if v is not None}],
        }
    )


@pytest.fixture
def attacher(monkeypatch: pytest.MonkeyPatch) -> tuple[ServerAttacher, list[StandInProxy]]:
    attached: list[StandInProxy] = []

    def start(self: ServerAttacher, dest: DeploymentRef, endpoint: Any, prefix: str) -> tuple[str, Any]:
        attached.append(StandInProxy(dest.pause_mode))
        return f"{prefix}{endpoint.pod}", attached[-1]

    monkeypatch.setattr(ServerAttacher, "_start", start)
    monkeypatch.setattr(
        ServerAttacher, "_check_attached", lambda self, dest, endpoint, handle, deadline: None
    )
    monkeypatch.setattr(vllm_servers.ray, "get", lambda call, timeout=None: call())
    monkeypatch.setattr(vllm_servers, "_kill", lambda entry: None)  # ray.kill would start Ray here
    pod = ServerPod(name="vllm-0", uid="uid-0", ip="10.1.0.5", ready=True)
    return ServerAttacher("ns", "policy", list_pods=lambda ns, labels: [pod]), attached


def test_a_changed_pause_mode_reaches_the_kept_proxy(attacher: tuple[ServerAttacher, list]) -> None:
    servers, attached = attacher
    servers(ref(None))  # attached with the default
    servers(ref("wait"))
    servers(ref("wait"))  # unchanged: no call
    servers(ref("abort"))
    servers(ref(None))  # unset again: back to keep
    (proxy,) = attached  # one proxy throughout: the same server process
    assert proxy.modes == ["keep", "wait", "abort", "keep"]


def test_a_new_attacher_does_not_inherit_modes(attacher: tuple[ServerAttacher, list]) -> None:
    servers, attached = attacher
    servers(ref("abort"))
    servers.close()
    servers(ref("abort"))  # attached again after close: with the spec's mode, no extra call
    assert [p.modes for p in attached] == [["abort"], ["abort"]]


def test_the_proxy_refuses_an_unknown_mode() -> None:
    assert vllm_ranks._pause_mode("abort") == "abort"
    with pytest.raises(DestinationError, match="expected one of keep, wait, abort"):
        vllm_ranks._pause_mode("drain")


def test_a_pause_change_keeps_the_runtime_pod() -> None:
    """The operator replaces the runtime pod only for what the runtime cannot take up itself."""
    base = topology_hash(spec_with(pause=None))
    assert topology_hash(spec_with(pause="abort")) == topology_hash(spec_with(pause="wait")) == base
    assert topology_hash(spec_with(pause="abort", port=9000)) != base  # control: a change it needs
