"""Oracle engines through the reference cache: a checkpoint-loaded vLLM engine is started only
when its outputs (generations, kernel checksums) are not cached for exactly its key
(sync_runtime/testing/reference_cache.py). Engine environment only.

    oracles = start_oracles(model_dir, namespace, {"ref": ("ref-x", {"tp": 2})}, calls=2)
    ...  # start the engines under test meanwhile
    outputs = finish_oracles(oracles)  # {"ref": {"calls": [Generation, ...], "kernels": [...]}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from sync_runtime.testing import reference_cache
from sync_runtime.testing import vllm_deploy as _deploy
from sync_runtime.testing.vllm_deploy import generations, stop_replicas, wait_ready
from sync_runtime.testing.vllm_oracle_keys import replica_oracle_key

__all__ = ["Oracles", "finish_oracles", "oracle_key", "start_oracles"]


def oracle_key(model_dir: str, engine: Mapping[str, Any], calls: int) -> dict[str, Any]:
    """The key of one oracle: `engine` are its start_replica arguments, `calls` how many times it
    generates PROMPTS (0: kernel checksums only); its value holds the kernel checksums too.
    Built by sync_runtime.testing.vllm_oracle_keys (the `--engine vllm` demo's key builder too)."""
    return replica_oracle_key(model_dir, engine, calls, kernel_checksums=True)


@dataclass
class Oracles:
    """Per oracle (by the caller's key): its cache key, how often it generates, the cached
    outputs (hits) or the engine started to compute them (misses)."""

    keys: dict[str, dict[str, Any]]
    calls: dict[str, int]
    cached: dict[str, Any]
    started: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)


def start_oracles(
    model_dir: str,
    namespace: str,
    engines: Mapping[str, tuple[str, dict[str, Any]]],
    calls: int | Mapping[str, int] = 1,
    start: Any = None,
) -> Oracles:
    """Look every oracle up; start (in the background) the engines of those not cached.
    `start(name, namespace, model_dir, **kw)` starts one (default: tests.support's start_replica,
    this clone on the workers' path)."""
    per = {k: calls if isinstance(calls, int) else calls[k] for k in engines}
    keys = {k: oracle_key(model_dir, kw, per[k]) for k, (_, kw) in engines.items()}
    oracles = Oracles(keys, per, {})
    for k, key in keys.items():
        value, status = reference_cache.load(key)
        oracles.statuses[k] = status
        if status == "hit":
            oracles.cached[k] = value
    if start is None:
        from tests.support.vllm_deploy import start_replica as start
    for k, (name, kw) in engines.items():
        if k not in oracles.cached:
            oracles.started[k] = start(name, namespace, model_dir, load_format="auto", **kw)
    return oracles


def finish_oracles(oracles: Oracles, timeout_s: float = _deploy.READY_TIMEOUT_S) -> dict[str, Any]:
    """Every oracle's {"calls": [Generation per call], "kernels": [per rank {name: checksum}]}:
    the started engines generate (concurrently, like the destinations), report their kernel
    checksums, are stored in the cache and stopped."""
    started = oracles.started
    try:
        wait_ready(list(started.values()), timeout_s=timeout_s)
        rounds = max((oracles.calls[k] for k in started), default=0)
        outputs: dict[str, Any] = {k: {"calls": [], "kernels": []} for k in started}
        for i in range(rounds):
            active = [k for k in started if oracles.calls[k] > i]
            for k, rows in zip(active, generations([started[k] for k in active]), strict=True):
                outputs[k]["calls"].append(rows)
        for k, handle in started.items():
            n = ray.get(handle.ws_num_ranks.remote())
            outputs[k]["kernels"] = [
                ray.get(handle.ws_rank_call.remote(i, "ws_kernel_checksums", ())) for i in range(n)
            ]
        for k, value in outputs.items():
            oracles.cached[k] = reference_cache.put(oracles.keys[k], value)
    finally:
        stop_replicas(list(started.values()))
    print(f"oracles: {oracles.statuses}")
    return dict(oracles.cached)
