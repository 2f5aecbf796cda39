"""Real vLLM engines as demo destinations: replica actors (`engines.vllm_replica.VllmReplica`,
dummy or checkpoint-loaded), their generations, the WeightSync that connects them to the demo's
Megatron-layout sources. Shared by `weightsync demo --engine vllm`, tests/engines and
bench/vllm_bench.py.

vLLM itself is imported only inside the replica actors (their processes run in the engine
environment, tools/vllm_env.sh); this module imports without it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ray

import sync_runtime
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.schema.crd import DeploymentRef, Parallelism, Transport, WeightSyncSpec
from sync_runtime.testing.vllm_models import MAX_TOKENS, PROMPTS

Generation = list[dict[str, list]]
"""One replica's answer to PROMPTS: per prompt {"token_ids": [...], "logprobs": [...]}."""
READY_TIMEOUT_S = 900.0
"""Engine start on a loaded 2-core machine: 2-6 minutes, several engines starting together."""
GENERATE_TIMEOUT_S = 600.0
"""PROMPTS on every replica: seconds when idle, but over 300 s once on a CI run's loaded machine."""
KV_CACHE_BYTES = 64 << 20
"""Every engine's KV cache (vLLM's `kv_cache_memory_bytes`, per worker): room for max_num_seqs (4)
sequences of max_model_len (128) tokens of every model here many times over (the benchmark's
317 MiB Qwen3 takes 16 KiB a token). vLLM's CPU worker zeroes the whole cache at start, so each
worker holds all of it: with `VLLM_CPU_KVCACHE_SPACE=1` (whole GiB, its smallest non-zero value)
a worker held 1.9 GiB against 1.0 with this, and CI's 24 GiB machine ran out with both test lanes'
engines up (Ray's memory monitor killed an engine worker at 95% used)."""


def engine_env(tp: int, pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """Environment of a replica actor and the vLLM worker processes it spawns."""
    package_root = str(Path(sync_runtime.__file__).resolve().parents[1])
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    cores = os.cpu_count() or 1
    return {
        # the spawned vLLM workers import sync_runtime (and a test's worker extension)
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([*pythonpath, package_root, *inherited])),
        # one core per TP worker, or every core for a single worker
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(tp))
        if tp > 1
        else f"0-{cores - 1}",
        "TOKENIZERS_PARALLELISM": "false",
        # The workers' OpenMP threads sleep at barriers instead of spinning: engines of both test
        # lanes share two cores, and a spinning worker holds a core another engine's worker waits
        # for (a TP2 engine's 4-prompt generation ran past 300 s beside the server demo in CI).
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def replica_env(tp: int, pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """engine_env plus vLLM's engine core in the replica actor's own process.

    `VllmReplica` drives a synchronous `vllm.LLM` behind one engine lock, so the engine core's
    own process (vLLM's default) buys it nothing, and it costs a third of a TP 2 start and over
    half of a TP 1 start (each spawned process imports torch and vLLM again): measured idle, a
    TP 1 engine up and generating in 10.6 s in-process against 29.2 s with the core apart. The
    engines users run (`vllm serve`, their own LLM/AsyncLLM actors) keep vLLM's default."""
    return {**engine_env(tp, pythonpath), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def start_replica(
    name: str,
    namespace: str,
    model_dir: str,
    *,
    tp: int,
    ep: bool = False,
    replica: int = 0,
    load_format: str = "dummy",
    extension: str | None = None,
    env: dict[str, str] | None = None,
    actor_class: type | None = None,
    engine_args: dict[str, Any] | None = None,
) -> Any:
    """A named `VllmReplica` actor (returns at once; its engine starts in the background:
    wait with `wait_ready`). `actor_class`: a VllmReplica subclass (the benchmark's);
    `engine_args`: more vLLM engine arguments (e.g. a speculative config), over the KV cache
    size (KV_CACHE_BYTES)."""
    from sync_runtime.engines.vllm_replica import WORKER_EXTENSION, VllmReplica, replica_options

    options = replica_options(name, namespace, tp, env if env is not None else replica_env(tp))
    return (
        ray.remote(actor_class or VllmReplica)
        .options(**options)
        .remote(
            model_dir,
            replica=replica,
            tensor_parallel_size=tp,
            enable_expert_parallel=ep,
            load_format=load_format,
            worker_extension_cls=extension or WORKER_EXTENSION,
            engine_args={"kv_cache_memory_bytes": KV_CACHE_BYTES, **(engine_args or {})},
        )
    )


def wait_ready(handles: Sequence[Any], timeout_s: float = READY_TIMEOUT_S) -> list[int]:
    """Block until every replica's engine is up (its ranks set up); their rank counts."""
    return list(ray.get([h.ws_num_ranks.remote() for h in handles], timeout=timeout_s))


def destination_ref(name: str, namespace: str, prefix: str, spec: ParallelSpec) -> DeploymentRef:
    return DeploymentRef(
        name=name,
        ray_address="-",
        ray_namespace=namespace,
        actor_prefix=prefix,
        layout="vllm",
        parallelism=Parallelism.from_spec(spec),
    )


def sync_spec(
    model_path: str,
    namespace: str,
    src: ParallelSpec,
    destinations: Sequence[DeploymentRef],
    version: str,
    **transport: Any,
) -> WeightSyncSpec:
    """Megatron sources (prefix `trainer-`) to the given vLLM destinations."""
    source = DeploymentRef(
        name="trainer",
        ray_address="-",
        ray_namespace=namespace,
        actor_prefix="trainer-",
        layout="megatron",
        parallelism=Parallelism.from_spec(src),
    )
    return WeightSyncSpec(
        source=source,
        destinations=list(destinations),
        version=version,
        model=model_path,
        transport=Transport(**{"transfer_timeout_seconds": 60, **transport}),
    )


def generations(handles: Sequence[Any], prompts: Sequence[Sequence[int]] = PROMPTS) -> list[Generation]:
    """Every replica's greedy generation of `prompts` (replicas concurrently), MAX_TOKENS each,
    each prompt alone: repeatable, so replicas and engines compare bit for bit (see generate)."""
    rows = [list(p) for p in prompts]
    calls = [h.generate.remote(rows, MAX_TOKENS, one_at_a_time=True) for h in handles]
    return list(ray.get(calls, timeout=GENERATE_TIMEOUT_S))


def rows_equal(a: Generation, b: Generation) -> int:
    """How many prompt rows agree exactly (token ids and every logprob bit)."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def token_rows_equal(a: Generation, b: Generation) -> int:
    """How many prompt rows have the same token ids (logprobs not compared)."""
    return sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b, strict=True))


def stop_replicas(handles: Sequence[Any]) -> None:
    """Stop each engine's processes, then the actor (idempotent; a dead engine is skipped)."""
    for h in handles:
        with contextlib.suppress(Exception):  # already stopped, or its engine died (fault tests)
            ray.get(h.shutdown.remote(), timeout=60)
        ray.kill(h)


def stop_engines_and_proxies(handles: Sequence[Any], proxies: Iterable[Any]) -> None:
    """`stop_replicas(handles)`, then kill the WeightSync proxies attached to them: the engines
    first, so that their workers leave the sync group before the proxy holding it goes."""
    stop_replicas(handles)
    for proxy in proxies:
        with contextlib.suppress(Exception):  # in a `finally`: never mask what failed before
            ray.kill(proxy)
