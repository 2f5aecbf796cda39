"""Test helpers for real vLLM destinations: the package's (sync_runtime.testing.vllm_models,
vllm_deploy) under their old names, with this clone and its tests on the workers' path (a
test's worker extension lives in tests.support).

Runs only under the engine environment (tools/vllm_env.sh); imported by tests/engines only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing import vllm_deploy as _deploy
from sync_runtime.testing.cluster import DemoSetup, create_participants, kill_participants
from sync_runtime.testing.vllm_deploy import (
    Generation,
    destination_ref,
    generations,
    rows_equal,
    stop_engines_and_proxies,
    stop_replicas,
    sync_spec,
    wait_ready,
)
from sync_runtime.testing.vllm_models import CONFIGS, MAX_TOKENS, PROMPTS, write_model
from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started
from tests.support.vllm_oracle import finish_oracles, start_oracles

ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "CONFIGS",
    "MAX_TOKENS",
    "PROMPTS",
    "ROOT",
    "Deployment",
    "deploy",
    "destination_ref",
    "engine_env",
    "generations",
    "kernel_checksums",
    "replica_env",
    "rows_equal",
    "start_replica",
    "stop_engines_and_proxies",
    "stop_replicas",
    "sync_spec",
    "user_engine_env",
    "wait_ready",
    "write_model",
]


def engine_env(tp: int) -> dict[str, str]:
    return _deploy.engine_env(tp, pythonpath=(str(ROOT), str(ROOT / "operator")))


def replica_env(tp: int) -> dict[str, str]:
    return _deploy.replica_env(tp, pythonpath=(str(ROOT), str(ROOT / "operator")))


def user_engine_env(workers: int) -> dict[str, str]:
    """The environment of the tests' user engines (`UserEngine` actors) of `workers` worker
    processes (TP x PP): with one, vLLM's engine core in the actor's process (`replica_env`: no
    process to start); with more, in its own process (vLLM's default, as users run it). A Ray
    actor can only spawn its children, each importing torch and vLLM again; its own engine core
    is then the one spawned process, and in the test session the core forks its workers
    (tests/support/session_site/sitecustomize.py), where with the core in the actor every worker
    would be spawned."""
    return replica_env(workers) if workers == 1 else engine_env(workers)


def start_replica(name: str, namespace: str, model_dir: str, *, tp: int, **kw: Any) -> Any:
    return _deploy.start_replica(name, namespace, model_dir, tp=tp, env=replica_env(tp), **kw)


@dataclass
class Deployment:
    """What `deploy` set up: the sources, the dummy engines, the references' generations."""

    setup: DemoSetup
    manifest: Manifest
    engines: dict[str, Any]
    reference_calls: list[dict[str, Generation]]
    """One entry per generate call of the reference engines (by key), in call order."""
    reference_kernels: dict[str, list[dict[str, str]]]
    """Per reference engine (by key), per rank: `kernel_checksums` before it was stopped."""
    users: dict[str, Any] = field(default_factory=dict)
    """Per user engine (by key): the `UserEngine` actor (generation, weight version)."""
    proxies: dict[str, Any] = field(default_factory=dict)
    """Per user engine (by key): its attached `VllmEngineRanks` proxy (ws_meta, kernel state)."""


def kernel_checksums(handle: Any) -> list[dict[str, str]]:
    """Per rank of one engine: the checksum of every tensor its kernels read (derived ones too)."""
    n = ray.get(handle.ws_num_ranks.remote())
    return [ray.get(handle.ws_rank_call.remote(i, "ws_kernel_checksums", ())) for i in range(n)]


EngineArgs = tuple[str, dict[str, Any]]
"""(actor name, start_replica keyword arguments)."""
UserEngineArgs = tuple[str, int] | tuple[str, int, dict[str, Any]]
"""(destination name prefix, TP[, more vLLM engine arguments, e.g. `enable_expert_parallel`]): a
`UserEngine` with the weightsync backend and dummy weights, attached as replica 0 of that
destination (its proxy is `{prefix}r0`)."""


def _user_engine_args(args: UserEngineArgs) -> tuple[str, int, dict[str, Any] | None]:
    """(prefix, TP, the extra engine arguments or None)."""
    return (args[0], args[1], args[2]) if len(args) == 3 else (args[0], args[1], None)


def _destinations(c: RankCoord) -> bool:
    return c.role is Role.DESTINATION  # the engines are the destinations: no demo actors for them


@contextlib.contextmanager
def deploy(
    model: str,
    directory: Path,
    *,
    src: str,
    dst: ParallelSpec,
    namespace: str,
    engines: Mapping[str, EngineArgs],
    references: Mapping[str, EngineArgs],
    reference_calls: int = 1,
    version: str = "v1",
    silent_references: Mapping[str, EngineArgs] | None = None,
    source_class: Any = None,
    user_engines: Mapping[str, UserEngineArgs] | None = None,
) -> Iterator[Deployment]:
    """Sources at v1 holding `model` (a CONFIGS key), dummy-weight engines, and reference engines
    loaded from the checkpoint of `version`; the references generate `reference_calls` times,
    report their kernel checksums and are stopped before the body runs (or, cached for their
    exact key, are not started at all). `silent_references` only
    report their checksums (an engine vLLM cannot generate with on CPU). `source_class(coord)`:
    the sources' actor class (default: the demo's Megatron-layout DemoSource). `user_engines`:
    plugin destinations, each started with `user_engine_env` and attached once up. Everything is
    stopped afterwards."""
    config = CONFIGS[model]
    manifest = build_manifest(config)
    ref_dir = write_model(directory, config, manifest, seed=0, version=version)
    setup = DemoSetup.create(f"{ref_dir}/config.json", src, dst, namespace=namespace, seed=0)
    started = {k: start_replica(name, namespace, ref_dir, **kw) for k, (name, kw) in engines.items()}
    users_args = {k: _user_engine_args(a) for k, a in (user_engines or {}).items()}
    users = {
        k: start_user_engine(ref_dir, tp, extra, env=user_engine_env(tp))
        for k, (_, tp, extra) in users_args.items()
    }
    proxies: dict[str, Any] = {}
    # the references run only on a reference-cache miss (tests/support/vllm_oracle.py)
    counts = {**dict.fromkeys(references, reference_calls), **dict.fromkeys(silent_references or {}, 0)}
    oracles = start_oracles(ref_dir, namespace, {**references, **(silent_references or {})}, counts)
    try:
        create_participants(
            setup, src_version="v1", dst_version="-", skip=_destinations, source_class=source_class
        )
        wait_ready(list(started.values()), timeout_s=800)
        wait_started(list(users.values()), timeout_s=800)
        for k, (prefix, tp, _) in users_args.items():
            (proxies[k],) = attach_user_engines([users[k]], prefix, namespace, tp=tp, timeout_s=800)
        out = finish_oracles(oracles, timeout_s=800)
        calls = [{k: out[k]["calls"][i] for k in references} for i in range(reference_calls)]
        kernels = {k: v["kernels"] for k, v in out.items()}
        yield Deployment(setup, manifest, started, calls, kernels, users, proxies)
    finally:
        stop_engines_and_proxies(
            [*started.values(), *users.values(), *oracles.started.values()], proxies.values()
        )
        kill_participants(setup)
