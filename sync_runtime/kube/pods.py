"""The `vllm serve` pods a `vllmServers` destination selects (the runtime Role's `list pods`).

`list_server_pods` is the only Kubernetes I/O here; everything else is pure, so the rules are
unit-tested on plain values: a pod serves only when it is Ready, has an IP and is not being
deleted; the Ready pods, ordered by name, are the destination's replicas 0..n-1 (a StatefulSet's
or LeaderWorkerSet's ordinal names keep their index; a Deployment's random suffixes give some
fixed order, which is all a replica index needs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sync_runtime.errors import DiscoveryError
from sync_runtime.kube.client import load_config


@dataclass(frozen=True, slots=True)
class ServerPod:
    """What the runtime needs of one pod the selector matched."""

    name: str
    uid: str
    ip: str | None
    ready: bool
    deleting: bool = False
    restarts: int = 0
    """Container restarts (kubelet's restartCount, summed): a restarted server is a new process
    with the same pod uid, whose weight-transfer backend must be set up again."""


@dataclass(frozen=True, slots=True)
class ServerEndpoint:
    """One Ready server: its replica index, pod and base URL of vLLM's routes."""

    replica: int
    pod: str
    uid: str
    url: str
    restarts: int = 0

    @property
    def instance(self) -> tuple[str, int, int]:
        """What one server process at one replica index is: pod uid, restarts, index."""
        return (self.uid, self.restarts, self.replica)


def label_selector(match_labels: Mapping[str, str]) -> str:
    """`matchLabels` as the API's `labelSelector` query (k=v,k2=v2; sorted, so it is stable)."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def server_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP goes in brackets
    return f"http://{host}:{port}"


def serving(pod: ServerPod) -> bool:
    return pod.ready and bool(pod.ip) and not pod.deleting


def endpoints(pods: Iterable[ServerPod], port: int) -> list[ServerEndpoint]:
    """The serving pods, ordered by name, as replicas 0..n-1."""
    live = sorted((p for p in pods if serving(p)), key=lambda p: p.name)
    return [
        ServerEndpoint(replica=k, pod=p.name, uid=p.uid, url=server_url(str(p.ip), port), restarts=p.restarts)
        for k, p in enumerate(live)
    ]


def replica_count_problem(
    deployment: str, selector: str, pods: Sequence[ServerPod], replicas: int, dp: int = 1
) -> str | None:
    """Why the serving pods do not make the declared replica count (None: they do). Each server
    runs `dp` data-parallel engines, each one replica: `replicas` needs replicas/dp pods."""
    live = [p.name for p in pods if serving(p)]
    if len(live) * dp == replicas:
        return None
    waiting = sorted(p.name for p in pods if not serving(p))
    shown = f"; not serving: {', '.join(waiting)}" if waiting else ""
    per = f" x dataParallelSize={dp}" if dp > 1 else ""
    return (
        f"deployment {deployment!r}: {len(live)} Ready vLLM server pod(s){per} match {selector!r}, "
        f"expected replicas={replicas}{shown}"
    )


def world_size_problem(
    deployment: str, pod: str, world_size: int, tp: int, pp: int, dp: int = 1, server_dp: int = 1
) -> str | None:
    """A server whose workers are not the declared TP x PP per engine, or whose data-parallel
    engines are not the declared `dp` (None: they are)."""
    if server_dp != dp:
        return (
            f"deployment {deployment!r}: vLLM server pod {pod} runs {server_dp} data-parallel engine(s), "
            f"the destination declares dataParallelSize={dp}"
        )
    if world_size == tp * pp * dp:
        return None
    per = f"*dp = {tp}*{pp}*{dp}" if dp > 1 else f" = {tp}*{pp}"
    return (
        f"deployment {deployment!r}: vLLM server pod {pod} runs {world_size} worker(s), "
        f"the declared parallelism needs tp*pp{per} = {tp * pp * dp}"
    )


def check_servers(
    deployment: str, selector: str, pods: Sequence[ServerPod], replicas: int, port: int, dp: int = 1
) -> list[ServerEndpoint]:
    """The destination's endpoints, one per serving pod (its first replica is index * dp);
    DiscoveryError when the serving pods are not its replica count (retryable: pods of a
    rollout or a restart become Ready again)."""
    problem = replica_count_problem(deployment, selector, pods, replicas, dp)
    if problem is not None:
        raise DiscoveryError(problem)
    return endpoints(pods, port)


def pod_of(obj: Any) -> ServerPod:
    """A `V1Pod` (kubernetes client) as a ServerPod."""
    status = obj.status
    conditions = (status.conditions or []) if status is not None else []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    containers = (status.container_statuses or []) if status is not None else []
    return ServerPod(
        name=obj.metadata.name,
        uid=obj.metadata.uid,
        ip=status.pod_ip if status is not None else None,
        ready=ready,
        deleting=obj.metadata.deletion_timestamp is not None,
        restarts=sum(int(c.restart_count or 0) for c in containers),
    )


def _core_api() -> Any:
    from kubernetes import client

    load_config(lambda e: DiscoveryError(f"vllmServers needs the Kubernetes API: {e}"))
    return client.CoreV1Api()


def list_server_pods(namespace: str, match_labels: Mapping[str, str], api: Any = None) -> list[ServerPod]:
    """The pods of `namespace` matching `match_labels`, Ready or not."""
    from kubernetes.client.rest import ApiException

    api = api or _core_api()
    selector = label_selector(match_labels)
    try:
        found = api.list_namespaced_pod(namespace, label_selector=selector)
    except ApiException as e:
        raise DiscoveryError(
            f"cannot list pods {selector!r} in {namespace}: HTTP {e.status} {e.reason}"
            + (" (the runtime's Role needs list on pods)" if e.status == 403 else "")
        ) from e
    return [pod_of(p) for p in found.items]
