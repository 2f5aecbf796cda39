"""bench/vllm_bench.py's summary and printed report: per phase, wall and CPU seconds by process
group against vLLM's reload; serving; where a warm sync goes (bench/vllm_server_breakdown.py)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

from bench.vllm_server_breakdown import summarize as breakdown

MiB = 1 << 20


def _median(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(key(r) for r in runs)


def _total_cpu(run: dict[str, Any]) -> float:
    return sum(run["cpu"].values())


def _thread_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r["threads"]})
    return {k: _median(runs, lambda r, k=k: r["threads"].get(k, 0.0)) for k in keys}


def cpu_lines(s: dict[str, Any]) -> list[str]:
    """Where a warm sync's CPU goes, by kind of thread, and the least wall time that CPU allows
    on this machine's cores (the sync and vLLM's reload share them with nothing else)."""
    cpu, cores = s["cpu_s"], s["cores"]
    warm, load = s["cpu_by_thread_s"]["warm_sync"], s["cpu_by_thread_s"]["load"]

    def of(t: dict[str, float], key: str) -> str:
        return f"{t.get(key, 0.0):.2f}"

    floor = cpu["warm_sync"]["total"] / cores
    return [
        f"CPU by thread (medians, CPU s), warm sync | reload: workers' main threads (vLLM's loop: it"
        f" runs each call; it busy-waits a second after each, but not from a sync's transfer to its resume)"
        f" {of(warm, 'workers.main')} | {of(load, 'workers.main')}; workers' other threads"
        f" (WeightSync's transfer and apply, torch's) {of(warm, 'workers.other')} |"
        f" {of(load, 'workers.other')}; workers' gloo I/O"
        f" {of(warm, 'workers.gloo')}; sources' main threads {of(warm, 'sources.main')}, gloo I/O"
        f" {of(warm, 'sources.gloo')}; vLLM's engine process(es) {cpu['warm_sync']['engine']:.2f} |"
        f" {cpu['load']['engine']:.2f}; proxy {cpu['warm_sync']['proxy']:.2f}",
        f"CPU-bound: the warm sync used {cpu['warm_sync']['total']:.2f} CPU s on this machine's {cores}"
        f" cores, at least {floor:.3f} s of wall ({floor / s['load_s']:.2f}x the reload; measured"
        f" {s['warm_sync_s']:.3f} s); vLLM's reload used {cpu['load']['total']:.2f} CPU s",
    ]


def summarize(res: dict[str, Any], model_bytes: int, file_bytes: int, tp: int) -> dict[str, Any]:
    """The run's figures (medians over the repeats), as printed and as JSON."""
    warm_s = _median(res["warm"], lambda r: r["seconds"])
    load_s = _median(res["load"], lambda r: r["seconds"])
    groups = res["cold"]["cpu"].keys()
    phases = (
        ("cold_sync", [res["cold"]]),
        ("warm_sync", res["warm"]),
        ("serving_warm_sync", res["serving"]),
        ("load", res["load"]),
    )
    idle_cps = res["idle_completions_per_s"]
    transfer_s = _median(res["serving"], lambda r: r["transfer_s"])
    commit_s = _median(res["serving"], lambda r: r["commit_s"])
    pauses = [p for p in res["pause_seconds"] if p is not None]
    return {
        "bench": "vllm",
        "engine": "vllm.LLM in a plain Ray actor, weightsync plugin, ActorControl",
        "model_bytes": model_bytes,
        "checkpoint_bytes": file_bytes,
        "tp": tp,
        "cold_sync_s": res["cold"]["seconds"],
        "warm_sync_s": warm_s,
        "serving_warm_sync_s": _median(res["serving"], lambda r: r["seconds"]),
        "load_s": load_s,
        "cold_over_load": res["cold"]["seconds"] / load_s,
        "warm_over_load": warm_s / load_s,
        "idle_completions_per_s": idle_cps,
        "during_sync_completions_per_s": res["during_sync_completions_per_s"],
        "during_sync_over_idle": res["during_sync_completions_per_s"] / idle_cps if idle_cps else None,
        "completions_failed": res["completions_failed"],
        "pause_seconds": res["pause_seconds"],
        "pause_s": statistics.median(pauses) if pauses else None,
        "pause_over_transfer": statistics.median(pauses) / transfer_s if pauses and transfer_s else None,
        "serving_transfer_s": transfer_s,
        "serving_commit_s": commit_s,
        "commit_over_transfer": commit_s / transfer_s if transfer_s else None,
        "breakdown": {"warm": breakdown([r["breakdown"] for r in res["warm"]])},
        "recv_bytes_per_worker": res["recv_bytes_per_worker"],
        "load_bytes_read_per_worker": file_bytes,
        "cpu_s": {
            phase: {g: _median(runs, lambda r, g=g: r["cpu"][g]) for g in groups}
            | {"total": _median(runs, _total_cpu)}
            for phase, runs in phases
        },
        "cpu_by_thread_s": {phase: _thread_medians(runs) for phase, runs in phases},
        "cores": len(os.sched_getaffinity(0)),
        "peak_worker_rss_mib": {phase: max(max(r["peak_rss_mib"]) for r in runs) for phase, runs in phases},
        "warm_plan_cached": all(r["plan_cached"] for r in res["warm"] + res["serving"]),
        "same_weights_sync_vs_load": res["same_weights"],
        "dummy_generation_differs": res["dummy_differs"],
    }


def breakdown_lines(c: dict[str, float]) -> list[str]:
    """Where a warm sync goes (medians; spans of different processes overlap in time)."""
    if not c:
        return []
    return [
        f"breakdown (warm, medians, overlapping): coordinator stages"
        f" discover {c['coordinator_discover_s']:.3f} plan {c['coordinator_plan_s']:.3f}"
        f" connect {c['coordinator_connect_s']:.3f}"
        f" transfer {c['coordinator_transfer_s']:.3f} verify {c['coordinator_verify_s']:.3f}"
        f" commit {c['coordinator_commit_s']:.3f}; proxy waiting for the workers"
        f" {c['proxy_await_answers_s']:.3f}",
        f"  wire (worker 0): ws_run {c['worker_transfer_run_s']:.3f} s = wire wait {c['wire_wait_s']:.3f}"
        f" + landing copy and receive checksums {c['recv_land_checksum_s']:.3f} + staging alloc"
        f" {c['staging_alloc_s']:.3f} (+ rest); sources: pack and checksum {c['source_pack_checksum_s']:.3f},"
        f" wire wait {c['source_wire_wait_s']:.3f}",
        f"  commit (worker 0): ws_commit {c['worker_commit_call_s']:.3f} s = staged checksums"
        f" {c['txn_staged_checksums_s']:.3f} + per-tensor checksums {c['commit_per_tensor_checksums_s']:.3f}"
        f" + apply {c['apply_s']:.3f} (staging copy {c['apply_copy_staged_s']:.3f}, vLLM post-processing"
        f" {c['apply_vllm_postprocess_s']:.3f})",
    ]


def print_table(s: dict[str, Any], idle_rss: list[float]) -> None:
    """The phases' table, then one line per other figure."""
    cpu = s["cpu_s"]
    groups = ("workers", "engine", "proxy", "sources", "driver")
    rows = [
        ("phase", "wall s", "/ load", "CPU s total", *groups, "peak RSS/worker"),
        *(
            (
                name,
                f"{s[key]:.3f}",
                f"{s[key] / s['load_s']:.2f}",
                f"{cpu[phase]['total']:.2f}",
                *(f"{cpu[phase][g]:.2f}" for g in groups),
                f"{s['peak_worker_rss_mib'][phase]:.0f} MiB",
            )
            for name, key, phase in (
                ("sync cold", "cold_sync_s", "cold_sync"),
                ("sync warm (median)", "warm_sync_s", "warm_sync"),
                ("sync warm, serving (median)", "serving_warm_sync_s", "serving_warm_sync"),
                ("vLLM reload (median)", "load_s", "load"),
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
        f"vLLM's reload reads the full {s['checkpoint_bytes'] / MiB:.1f} MiB checkpoint on each worker"
    )
    print(f"worker RSS before the phases: {', '.join(f'{r:.0f}' for r in idle_rss)} MiB")
    ratio = s["during_sync_over_idle"]
    print(
        f"serving: {s['idle_completions_per_s']:.2f} completions/s idle, "
        f"{s['during_sync_completions_per_s']:.2f} during warm syncs "
        f"({f'{ratio:.2f}x' if ratio is not None else 'n/a'}); failed: {s['completions_failed']}"
    )
    pause, ratio = s["pause_s"], s["pause_over_transfer"]
    pause_txt = f"{pause:.3f} s" if pause is not None else "n/a"
    ratio_txt = f"{ratio:.2f}x" if ratio is not None else "n/a"
    print(
        f"per warm sync while serving (medians): pause {pause_txt} (the proxy's pause to resume, the"
        f" apply inside) vs transfer {s['serving_transfer_s']:.3f} s ({ratio_txt}); commit stage"
        f" {s['serving_commit_s']:.3f} s; pauses {s['pause_seconds']}"
    )
    print("\n".join(breakdown_lines(s["breakdown"]["warm"])))
    print("\n".join(cpu_lines(s)))
    print(
        "greedy generation after the v1 sync == after vLLM's reload of the v1 checkpoint: "
        f"{s['same_weights_sync_vs_load']}; dummy-weight generation differs from it: "
        f"{s['dummy_generation_differs']}"
    )
