"""`vllmServers` destinations in discovery: their engines' proxies are attached before each sync.

A `vllmServers` destination names `vllm serve` pods by label instead of Ray actors. Before each
discovery, the installed attacher lists the Ready pods, checks each server's world size against
the declared parallelism (before any byte moves), and keeps one `VllmEngineRanks` proxy actor per
pod in the source's Ray cluster, named under one prefix per destination; discovery then finds
them by that prefix like any destination's actors.

The attacher lives in the engine layer (`sync_runtime.engines.vllm_servers`), above the runtime,
so it is installed by the entry point (`weightsync run`), not imported from here.
"""

from __future__ import annotations

from collections.abc import Callable

from sync_runtime.errors import DiscoveryError
from sync_runtime.schema.crd import DeploymentRef, WeightSyncSpec

ServerAttacher = Callable[[DeploymentRef], str]
"""Attaches (or keeps) the proxies of one vllmServers destination; returns their actor prefix."""

_attacher: ServerAttacher | None = None


def install(attacher: ServerAttacher | None) -> None:
    """Set (None: remove) the attacher discovery uses for vllmServers destinations."""
    global _attacher
    _attacher = attacher


def with_server_actors(spec: WeightSyncSpec) -> WeightSyncSpec:
    """`spec` with each vllmServers destination's proxies attached and its actorPrefix set to
    theirs (the spec the runtime discovers with; the CR keeps no prefix)."""
    if all(d.vllm_servers is None for d in spec.destinations):
        return spec
    if _attacher is None:
        raise DiscoveryError(
            "a vllmServers destination needs the server attacher of `weightsync run` "
            "(sync_runtime.engines.vllm_servers.install)"
        )
    attach = _attacher
    dests = [
        d if d.vllm_servers is None else d.model_copy(update={"actor_prefix": attach(d)})
        for d in spec.destinations
    ]
    return spec.model_copy(update={"destinations": dests})
