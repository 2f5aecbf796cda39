"""The attacher of `vllmServers` destinations: one `VllmEngineRanks` proxy per Ready server pod.

Installed by `weightsync run` (`install`); discovery calls it before each sync
(runtime/servers.py). Per destination it lists the pods the selector matches (kube/pods.py),
refuses a replica count or a server world size (TP x PP x DP) that differs from the declared
parallelism and `dataParallelSize`, one line naming the pod (each DP engine of a server is a
replica: pod k holds replicas k*D .. k*D+D-1, all behind the pod's one proxy; with wide EP,
`parallelism.dp` = D and ep = tp*D, pod k is replica k, its D engines together), and a server
whose engines are not laid out so (wide EP served without expert parallel, or the reverse:
`expert_layout_problem`), and keeps one
proxy actor per server process at its replica index (pod uid, container restarts, index): a
proxy whose pod is gone, replaced (new uid), restarted (its container's restart count grew) or
moved to another index is killed and a new one attached, so a restarted server joins the next
sync. A kept proxy is given the spec's pause mode when that changed (a `kubectl patch` of
`pause` applies from the next sync). The proxies are owned by this process (not detached):
they end with the runtime.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.errors import (
    DestinationError,
    DiscoveryError,
    ParticipantDied,
    TopologyMismatchError,
    WeightSyncError,
    describe_unexpected,
)
from sync_runtime.kube.pods import (
    ServerEndpoint,
    ServerPod,
    check_servers,
    label_selector,
    list_server_pods,
    world_size_problem,
)
from sync_runtime.runtime import servers
from sync_runtime.schema.crd import DeploymentRef

log = logging.getLogger("weightsync.servers")
ATTACH_TIMEOUT_S = 300.0
"""A new proxy's setup: `init_weight_transfer_engine` on every worker of its server."""

ATTACH_ERRORS = (DiscoveryError, TopologyMismatchError)
"""What attaching one server pod raises (naming the pod)."""

PodLister = Callable[[str, Mapping[str, str]], Sequence[ServerPod]]


def proxy_prefix(weightsync: str, deployment: str) -> str:
    """Actor-name prefix of one destination's proxies. Dots cannot occur in either name, so no
    destination's prefix is a prefix of another's."""
    return f"wsservers.{weightsync}.{deployment}."


class ServerAttacher:
    """`runtime.servers.ServerAttacher` over the Kubernetes API and vLLM's HTTP routes."""

    def __init__(
        self,
        namespace: str,
        weightsync: str,
        list_pods: PodLister = list_server_pods,
        timeout_s: float = ATTACH_TIMEOUT_S,
    ) -> None:
        self.namespace, self.weightsync = namespace, weightsync
        self._list, self._timeout_s = list_pods, timeout_s
        self._proxies: dict[str, dict[tuple[str, int, int], tuple[str, Any]]] = {}
        self._modes: dict[str, str] = {}
        """The pause mode each held proxy (by actor name) was last given."""

    def __call__(self, ref: DeploymentRef) -> str:
        conf = ref.vllm_servers
        if conf is None:
            raise DiscoveryError(f"deployment {ref.name!r} names no vllmServers")
        labels = conf.selector.match_labels
        pods = self._list(self.namespace, labels)
        per_pod = 1 if wide_ep(ref) else conf.data_parallel_size  # replicas per server pod
        found = check_servers(
            ref.name, label_selector(labels), pods, ref.parallelism.replicas, conf.port, per_pod
        )
        held = self._proxies.setdefault(ref.name, {})
        wanted = {e.instance for e in found}
        for key in [k for k in held if k not in wanted]:
            self._modes.pop(held[key][0], None)
            _kill(held.pop(key))
        prefix = proxy_prefix(self.weightsync, ref.name)
        new: list[ServerEndpoint] = []
        for e in found:
            key = e.instance
            if key in held and _alive(held[key][1]):
                self._keep_pause_mode(held[key], ref.pause_mode)
                continue
            if key in held:
                _kill(held.pop(key))
            new.append(e)
        attached, failure = self._attach_all(ref, new, prefix)
        for e, entry in attached:
            held[e.instance] = entry
            self._modes[entry[0]] = ref.pause_mode
        if failure is not None:
            raise failure
        return prefix

    def _keep_pause_mode(self, entry: tuple[str, Any], mode: str) -> None:
        """A kept proxy takes the spec's pause mode: a spec change (e.g. `kubectl patch` of
        destinations[].pause) reaches the runtime's next sync through the same proxy."""
        name, handle = entry
        if self._modes.get(name) == mode:
            return
        try:
            ray.get(handle.ws_set_pause_mode.remote(mode), timeout=self._timeout_s)
        except ray.exceptions.RayError as err:
            raise DiscoveryError(f"proxy {name}: pause mode {mode}: {describe_unexpected(err)}") from err
        self._modes[name] = mode
        log.info("%s: pause %s", name, mode)

    def close(self) -> None:
        """End every proxy this attacher holds (they also end with this process)."""
        for held in self._proxies.values():
            for entry in held.values():
                _kill(entry)
        self._proxies.clear()
        self._modes.clear()

    def _attach_all(
        self, ref: DeploymentRef, endpoints: Sequence[ServerEndpoint], prefix: str
    ) -> tuple[list[tuple[ServerEndpoint, tuple[str, Any]]], WeightSyncError | None]:
        """Attach a proxy to each of `endpoints` at once: every proxy is started before any is
        waited for, so a destination of N new pods costs one proxy start (a Ray worker that
        imports torch, then `init_weight_transfer_engine` on the server's workers), not N in a
        row. Returns the proxies that attached and the first failure in pod order (a failed
        pod's proxy is killed; the others are kept for the next sync)."""
        started: list[tuple[ServerEndpoint, str, Any]] = []
        failure: WeightSyncError | None = None
        for e in endpoints:
            try:
                started.append((e, *self._start(ref, e, prefix)))
            except ATTACH_ERRORS as err:
                failure = failure or err
        attached: list[tuple[ServerEndpoint, tuple[str, Any]]] = []
        deadline = time.monotonic() + self._timeout_s
        for e, name, handle in started:
            try:
                self._check_attached(ref, e, handle, deadline)
            except ATTACH_ERRORS as err:
                _kill((name, handle))
                failure = failure or err
                continue
            attached.append((e, (name, handle)))
        return attached, failure

    def _start(self, ref: DeploymentRef, e: ServerEndpoint, prefix: str) -> tuple[str, Any]:
        """Check one server's world size over HTTP and start its proxy (not waited for)."""
        control = HttpControl(e.url)
        try:
            world, server_dp = control.world_size(), control.data_parallel_size()
        except (DestinationError, ParticipantDied) as err:  # no answer, or the connection broke
            raise DiscoveryError(f"{_where(ref, e)}: {err.message}") from err
        p, dp = ref.parallelism, _server_dp(ref)
        problem = world_size_problem(ref.name, e.pod, world, p.tp, p.pp, dp, server_dp)
        if problem is not None:
            raise TopologyMismatchError(problem)
        name = f"{prefix}{e.replica:04d}.{e.pod}.{e.uid[:8]}.{e.restarts}"
        # a data-parallel server's DP engines are replicas e.replica*dp .. +dp-1 (one proxy each
        # server); a wide-EP server is one replica, e.replica
        first = e.replica if wide_ep(ref) else e.replica * dp
        handle = attach(name, ref.ray_namespace, control, replica=first, pause=ref.pause_mode, ranks=world)
        return name, handle

    def _check_attached(self, ref: DeploymentRef, e: ServerEndpoint, handle: Any, deadline: float) -> None:
        """Wait for one started proxy's ranks and check its DP engines' layout."""
        try:  # the proxy's constructor runs init_weight_transfer_engine on every worker
            metas = ray.get(handle.ws_meta.remote(), timeout=max(deadline - time.monotonic(), 1.0))
        except ray.exceptions.RayError as err:
            raise DiscoveryError(
                f"{_where(ref, e)}: the weightsync backend did not start: {describe_unexpected(err)}"
            ) from err
        dp = _server_dp(ref)
        replicas = len({m.coord.replica for m in metas})
        problem = expert_layout_problem(ref.name, e.pod, dp, wide_ep(ref), replicas)
        if problem is not None:
            raise TopologyMismatchError(problem)
        log.info(
            "attached %s (replica %d, %d worker(s), dp %d, pause %s)",
            e.pod,
            e.replica,
            len(metas),
            dp,
            ref.pause_mode,
        )


def _where(ref: DeploymentRef, e: ServerEndpoint) -> str:
    return f"deployment {ref.name!r}: vLLM server pod {e.pod} ({e.url})"


def _server_dp(ref: DeploymentRef) -> int:
    return ref.vllm_servers.data_parallel_size if ref.vllm_servers else 1


def wide_ep(ref: DeploymentRef) -> bool:
    """The destination declares vLLM's wide EP: `parallelism.dp` > 1 (with ep = tp*dp, the
    schema's rule), each server one replica of its DP engines together."""
    return ref.parallelism.dp > 1


def expert_layout_problem(deployment: str, pod: str, dp: int, wide: bool, replicas: int) -> str | None:
    """A server whose DP engines are not laid out as declared (None: they are): with wide EP
    (`--enable-expert-parallel` on a MoE model) its workers report one replica together, else
    one per DP engine (engines/vllm_worker._worker_coord)."""
    if dp == 1 or replicas == (1 if wide else dp):
        return None
    runs = "expert parallel across" if replicas == 1 else "whole model copies on"
    declared = f"wide EP (parallelism.dp={dp})" if wide else "one replica per DP engine (parallelism.dp=1)"
    return (
        f"deployment {deployment!r}: vLLM server pod {pod} runs {runs} its {dp} data-parallel engines, "
        f"the destination declares {declared}"
    )


def _alive(handle: Any) -> bool:
    try:
        ray.get(handle.ws_num_ranks.remote(), timeout=10.0)
    except ray.exceptions.RayError:
        return False
    return True


def _kill(entry: tuple[str, Any]) -> None:
    try:
        ray.kill(entry[1])
    except Exception as e:  # already gone with its server or its node: nothing left to end
        log.info("proxy %s: %s", entry[0], describe_unexpected(e))


def install(namespace: str | None, weightsync: str | None) -> None:
    """Install the attacher for the runtime's WeightSync (`weightsync run`)."""
    ns = namespace or os.environ.get("POD_NAMESPACE") or "default"
    servers.install(ServerAttacher(ns, weightsync or "weightsync"))
