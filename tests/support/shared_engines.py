"""Engines shared by the test modules of one session that start the same configuration.

A CPU vLLM engine (or `vllm serve`) costs 20-70 s to start; modules that start the same
configuration (model config, TP, dtype, dummy weights, server flags) share one through a
module-scoped fixture of tests/engines/conftest.py. The engine starts on the first module's
request, is re-synced (not restarted) by the next module, and is stopped after the last module
of the session that uses it: its users are the modules of the collected tests whose fixtures
include it (`note_users`, at collection), so a module run alone starts and stops its own as before.

What an engine's first state was is kept with it (`dummy`: its generation on dummy weights before
any sync), so a module's "the dummy weights generate otherwise" control does not depend on what
ran before it. A test that kills or corrupts an engine keeps its own; a shared engine that died
anyway is started again (`healthy`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ray

from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.vllm_deploy import Generation, generations, stop_engines_and_proxies
from sync_runtime.testing.vllm_models import CONFIGS, write_model

USERS: dict[str, set[str]] = {}
"""Per shared fixture: the modules of this session's collected tests that use it."""
PENDING: dict[str, set[str]] = {}
"""Per shared fixture: the collected tests that use it and have not finished yet."""
STARTS: dict[str, int] = {}
"""Per shared fixture: how many times its engine was started in this session."""


def note_users(items: Sequence[pytest.Item], fixtures: Sequence[str]) -> None:
    """Record, per shared fixture, which modules' tests use it (directly or through another)."""
    for name in fixtures:
        users = [item for item in items if name in getattr(item, "fixturenames", ())]
        USERS[name] = {_module(item) for item in users}
        PENDING[name] = {item.nodeid for item in users}


def group_modules(items: list[pytest.Item], fixtures: Sequence[str]) -> None:
    """Reorder `items` in place so that the modules sharing a fixture run one after another
    (each group where its first module was; the tests of a module keep their order): a shared
    engine is then never idle while other modules start theirs. A module that kills a shared
    engine on purpose (its `RETIRES_SHARED` names the fixture) runs last in its group, so that
    no other module has to start the engine again."""
    order = list(dict.fromkeys(_module(item) for item in items))
    retires = {
        _module(item): bool(getattr(getattr(item, "module", None), "RETIRES_SHARED", ())) for item in items
    }
    lead = {m: m for m in order}
    for name in fixtures:
        users = [m for m in order if m in USERS.get(name, ())]
        for m in users[1:]:
            lead[m] = lead[users[0]]
    rank = {m: i for i, m in enumerate(order)}
    position = {m: (rank[lead[m]], retires[m], rank[m]) for m in order}
    items.sort(key=lambda item: position[_module(item)])


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else item.nodeid.split("::")[0]


@dataclass
class Held:
    value: Any
    stop: Callable[[Any], None]
    healthy: Callable[[Any], bool]


@dataclass
class SharedEngines:
    """The session's shared engines by fixture name."""

    held: dict[str, Held] = field(default_factory=dict)

    @contextlib.contextmanager
    def use(
        self, name: str, start: Callable[[], Any], stop: Callable[[Any], None], healthy: Callable[[Any], bool]
    ) -> Iterator[Any]:
        """The engine of `name` (started now if none is held or it died); stopped on the way out
        when no test of the session that uses it is left (else by `finished`, after the last)."""
        held = self.held.get(name)
        if held is not None and not held.healthy(held.value):
            self.stop(name)
            held = None
        if held is None:
            held = self.held[name] = Held(start(), stop, healthy)
            STARTS[name] = STARTS.get(name, 0) + 1
        try:
            yield held.value
        finally:
            if not PENDING.get(name):
                self.stop(name)

    def finished(self, nodeid: str) -> None:
        """A test ended: stop each engine that no test left in the session uses."""
        for name, pending in PENDING.items():
            if nodeid in pending:
                pending.discard(nodeid)
                if not pending:
                    self.stop(name)

    def retire(self, name: str) -> None:
        """A test killed `name`'s engine on purpose: stop it now (a later user starts another)."""
        self.stop(name)

    def stop(self, name: str) -> None:
        held = self.held.pop(name, None)
        if held is not None:
            held.stop(held.value)

    def close(self) -> None:
        for name in list(self.held):
            self.stop(name)


POOL = SharedEngines()
"""The session's (tests/engines/conftest.py)."""


@dataclass
class SharedReplica:
    """A dummy-weight user's engine through the weightsync plugin, shared by modules: a
    `UserEngine` (sync_runtime/testing/vllm_user_engines.py, a plain Ray actor holding `vllm.LLM`
    with the weightsync backend) attached with `ActorControl`; its destination is (namespace,
    prefix), replica 0 of which is the proxy `{prefix}r0`."""

    handle: Any
    """The user's actor: generation, vLLM's weight version."""
    proxy: Any
    """Its attached `VllmEngineRanks` proxy: ws_meta, ws_rank_call, kernel state, weight version."""
    namespace: str
    prefix: str
    model_dir: str
    dummy: Generation
    """Its generation of PROMPTS on dummy weights, before any sync."""
    dummy_kernels: list[dict[str, str]]
    """Per rank, the checksums of the tensors its kernels read, on dummy weights."""


def start_shared_replica(
    model: str, directory: Path, namespace: str, prefix: str, *, tp: int
) -> SharedReplica:
    """A dummy-weight user's engine of CONFIGS[model] at `tp`, up and attached (started with
    `user_engine_env`, as tests/support/vllm_deploy.py's `deploy` starts its user engines), with its
    dummy state recorded."""
    from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started
    from tests.support.vllm_deploy import kernel_checksums, user_engine_env

    config = CONFIGS[model]
    model_dir = write_model(directory, config, build_manifest(config), seed=0, version="v1")
    handle = start_user_engine(model_dir, tp, env=user_engine_env(tp))
    proxies: list[Any] = []
    try:
        wait_started([handle], timeout_s=800)
        proxies = attach_user_engines([handle], prefix, namespace, tp=tp, timeout_s=800)
        dummy = generations([handle])[0]
        kernels = kernel_checksums(proxies[0])
        return SharedReplica(handle, proxies[0], namespace, prefix, model_dir, dummy, kernels)
    except BaseException:
        stop_engines_and_proxies([handle], proxies)
        raise


def replica_alive(shared: SharedReplica) -> bool:
    """The user's actor and its proxy both reach the engine."""
    try:
        ray.get([shared.handle.weight_version.remote(), shared.proxy.weight_version.remote()], timeout=60)
    except Exception:  # a dead actor, proxy or engine: start another
        return False
    return True


def stop_shared_replica(shared: SharedReplica) -> None:
    stop_engines_and_proxies([shared.handle], [shared.proxy])


@dataclass
class SharedPair:
    """Dummy-weight TP 1 user's engines through the weightsync plugin (replicas 0, 1), shared by
    modules: `UserEngine`s (plain Ray actors holding `vllm.LLM` with the weightsync backend and a
    test worker extension) attached with `ActorControl`; their destination is (namespace,
    prefix), replica k of which is the proxy `{prefix}r{k}`."""

    handles: list[Any]
    """The users' actors: generation, vLLM's weight version, the worker extension's test hooks."""
    proxies: list[Any]
    """Their attached `VllmEngineRanks` proxies: ws_meta, ws_rank_call, weight version."""
    namespace: str
    prefix: str
    model_dir: str
    dummy: list[Generation]
    """Per replica, its generation of PROMPTS on dummy weights, before any sync."""


def start_shared_pair(
    model: str, directory: Path, namespace: str, prefix: str, *, extension: str, replicas: int = 2
) -> SharedPair:
    """`replicas` dummy-weight TP 1 user's engines of CONFIGS[model] (started together, with
    `user_engine_env(1)`: vLLM's engine core in the actor's process),
    whose workers carry the test worker extension `extension` (vLLM's `worker_extension_cls`),
    up and attached as replicas 0.. of one destination, with their dummy generations recorded."""
    from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started
    from tests.support.vllm_deploy import user_engine_env

    config = CONFIGS[model]
    model_dir = write_model(directory, config, build_manifest(config), seed=0, version="v1")
    extra = {"worker_extension_cls": extension}
    handles = [start_user_engine(model_dir, 1, extra, env=user_engine_env(1)) for _ in range(replicas)]
    proxies: list[Any] = []
    try:
        wait_started(handles, timeout_s=800)
        proxies = attach_user_engines(handles, prefix, namespace, tp=1, timeout_s=800)
        return SharedPair(handles, proxies, namespace, prefix, model_dir, generations(handles))
    except BaseException:
        stop_engines_and_proxies(handles, proxies)
        raise


def pair_alive(shared: SharedPair) -> bool:
    """Every replica's engine answers a call that reaches its workers (a rank killed by a fault
    test leaves the user's actor and its proxy up and its engine dead: the proxy's ws_meta then
    fails at vLLM's `start_weight_update`), and every user's actor answers."""
    try:
        calls = [p.ws_meta.remote() for p in shared.proxies] + [
            h.weight_version.remote() for h in shared.handles
        ]
        ray.get(calls, timeout=60)
    except Exception:  # a dead actor, proxy or engine: start another pair
        return False
    return True


def stop_shared_pair(shared: SharedPair) -> None:
    stop_engines_and_proxies(shared.handles, shared.proxies)
