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
        for e in found:
            key = e.instance
            if key in held and _alive(held[key][1]):
                self._keep_pause_mode(held[key], ref.pause_mode)
                continue
            if key in held:
                _kill(held.pop(key))
            held[key] = self._attach(ref, e, prefix)
            self._modes[held[key][0]] = ref.pause_mode
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

    def _attach(self, ref: DeploymentRef, e: ServerEndpoint, prefix: str) -> tuple[str, Any]:
        where = f"deployment {ref.name!r}: vLLM server pod {e.pod} ({e.url})"
        control = HttpControl(e.url)
        try:
            world, server_dp = control.world_size(), control.data_parallel_size()
        except (DestinationError, ParticipantDied) as err:  # no answer, or the connection broke
            raise DiscoveryError(f"{where}: {err.message}") from err
        p, dp = ref.parallelism, ref.vllm_servers.data_parallel_size if ref.vllm_servers else 1
        problem = world_size_problem(ref.name, e.pod, world, p.tp, p.pp, dp, server_dp)
        if problem is not None:
            raise TopologyMismatchError(problem)
        name = f"{prefix}{e.replica:04d}.{e.pod}.{e.uid[:8]}.{e.restarts}"
        # a data-parallel server's DP engines are replicas e.replica*dp .. +dp-1 (one proxy each
        # server); a wide-EP server is one replica, e.replica
        wide = wide_ep(ref)
        first = e.replica if wide else e.replica * dp
        handle = attach(name, ref.ray_namespace, control, replica=first, pause=ref.pause_mode, ranks=world)
        try:  # the proxy's constructor runs init_weight_transfer_engine on every worker
            metas = ray.get(handle.ws_meta.remote(), timeout=self._timeout_s)
        except ray.exceptions.RayError as err:
            _kill((name, handle))
            raise DiscoveryError(
                f"{where}: the weightsync backend did not start: {describe_unexpected(err)}"
            ) from err
        problem = expert_layout_problem(ref.name, e.pod, dp, wide, len({m.coord.replica for m in metas}))
        if problem is not None:
            _kill((name, handle))
            raise TopologyMismatchError(problem)
        log.info(
            "attached %s (replica %d, %d worker(s), dp %d, pause %s)",
            e.pod,
            e.replica,
            world,
            dp,
            ref.pause_mode,
        )
        return name, handle


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
