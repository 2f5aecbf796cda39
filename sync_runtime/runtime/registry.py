"""Registration: existing Ray actors take part in a WeightSync without being renamed.

Discovery finds a deployment's participants by Ray namespace and actor-name prefix
(`rayNamespace`, `actorPrefix`), and also takes every actor registered for the deployment:

    register("trainer", namespace="rl")                   # inside a trainer actor: itself
    register("trainer", handles, namespace="rl")          # from the driver: any actor handles

`deployment` is the deployment's `name` in the WeightSync (`spec.source.name` or a
destination's name), `namespace` its `rayNamespace`. The handles live in one named, detached
Ray actor per namespace (`weightsync-registry`), so a registration outlives the process that
made it and any driver of the cluster (the runtime pod, an `InProcessSync`) sees it. Holding a
handle there does not change who owns the actor: it still dies with its owner.

Names still only select candidates: identity comes from the coordinates each participant
reports, and the topology check is the same for registered and prefixed actors. A registered
actor that has died since is dropped from the registry when discovery finds it dead (then the
topology check reports its rank missing); `unregister` drops registrations explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

log = logging.getLogger("weightsync.registry")
REGISTRY_NAME = "weightsync-registry"
"""The registry actor's name in each Ray namespace that has registrations."""


@dataclass(frozen=True, slots=True)
class Registration:
    actor_id: str
    """Ray's actor id (hex): registering an actor twice keeps one entry."""
    name: str
    """What messages and reports call it: its Ray name if it has one, else `deployment@id`."""
    handle: Any


class _Registry:
    """The per-namespace registry actor: deployment -> actor id -> (name, handle)."""

    def __init__(self) -> None:
        self._by_deployment: dict[str, dict[str, tuple[str, Any]]] = {}

    def add(self, deployment: str, entries: list[tuple[str, str, Any]]) -> int:
        table = self._by_deployment.setdefault(deployment, {})
        for actor_id, name, handle in entries:
            table[actor_id] = (name, handle)
        return len(table)

    def remove(self, deployment: str, actor_ids: list[str] | None) -> int:
        table = self._by_deployment.get(deployment, {})
        gone = list(table) if actor_ids is None else [a for a in actor_ids if a in table]
        for actor_id in gone:
            del table[actor_id]
        return len(gone)

    def entries(self, deployment: str) -> list[tuple[str, str, Any]]:
        table = self._by_deployment.get(deployment, {})
        return [(actor_id, name, handle) for actor_id, (name, handle) in sorted(table.items())]


def actor_id(handle: Any) -> str:
    """A handle's actor id (hex), the key that makes a registered and a prefixed actor one."""
    return str(handle._actor_id.hex())


def _registry(namespace: str, *, create: bool) -> Any | None:
    if create:
        return (
            ray.remote(_Registry)
            .options(
                name=REGISTRY_NAME,
                namespace=namespace,
                lifetime="detached",  # registrations outlive the process that made them
                get_if_exists=True,  # several ranks registering at once share one registry
                num_cpus=0,
            )
            .remote()
        )
    try:
        return ray.get_actor(REGISTRY_NAME, namespace=namespace)
    except ValueError:  # nothing was ever registered in this namespace
        return None


def _entries(
    deployment: str, actors: Any | Sequence[Any] | None, names: Sequence[str] | None
) -> list[tuple[str, str, Any]]:
    if actors is None:  # called inside an actor: register that actor
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            raise ValueError("register() without actors must be called inside a Ray actor")
        handle = ctx.current_actor
        aid = actor_id(handle)
        return [(aid, ctx.get_actor_name() or f"{deployment}@{aid[:12]}", handle)]
    handles = list(actors) if isinstance(actors, list | tuple) else [actors]
    if names is not None and len(names) != len(handles):
        raise ValueError(f"register(): {len(names)} names for {len(handles)} actors")
    out = []
    for i, handle in enumerate(handles):
        aid = actor_id(handle)
        out.append((aid, names[i] if names is not None else f"{deployment}@{aid[:12]}", handle))
    return out


def register(
    deployment: str,
    actors: Any | Sequence[Any] | None = None,
    *,
    namespace: str,
    names: Sequence[str] | None = None,
) -> int:
    """Register `actors` (one handle or several; None: the calling actor itself) as participants
    of `deployment` in Ray namespace `namespace`. `names`: how messages and reports call them.
    Returns how many actors the deployment now has registered."""
    entries = _entries(deployment, actors, names)
    registry = _registry(namespace, create=True)
    return int(ray.get(registry.add.remote(deployment, entries)))


def unregister(deployment: str, actors: Any | Sequence[Any] | None = None, *, namespace: str) -> int:
    """Drop registrations of `deployment` (the given actors, or all of them); returns how many."""
    registry = _registry(namespace, create=False)
    if registry is None:
        return 0
    ids = None if actors is None else [a for a, _, _ in _entries(deployment, actors, None)]
    return int(ray.get(registry.remove.remote(deployment, ids)))


def registered(namespace: str, deployment: str) -> list[Registration]:
    """The actors registered for `deployment` in `namespace`, in actor-id order."""
    registry = _registry(namespace, create=False)
    if registry is None:
        return []
    return [Registration(a, n, h) for a, n, h in ray.get(registry.entries.remote(deployment))]


def forget_dead(namespace: str, deployment: str, dead: Sequence[Registration]) -> None:
    """Discovery found these registered actors dead: drop them (their ranks then show as missing)."""
    registry = _registry(namespace, create=False)
    if registry is not None and dead:
        log.warning(
            "deployment %s: dropping dead registered actor(s) %s", deployment, ", ".join(d.name for d in dead)
        )
        ray.get(registry.remove.remote(deployment, [d.actor_id for d in dead]))


__all__ = ["REGISTRY_NAME", "Registration", "actor_id", "forget_dead", "register", "registered", "unregister"]
