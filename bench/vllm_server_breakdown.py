"""Where a warm sync into a `vllm serve` replica spends its time (bench/vllm_server_bench.py).

Every process of the sync keeps a tally of named phases (sync_runtime/transfer/spans.py): the
proxy actor (vLLM's HTTP routes, waits for the workers' answers), the vLLM worker (the
transfer engine on its background thread, the two-phase commit's checksums, the apply's
steps), the source actors (packing and checksumming what they send). After each sync they are
collected, with the coordinator's stage seconds from the report. Before each sync every tally
is reset, so the figures are of that sync alone.

The categories below sum spans of different processes that partly overlap in time (the
sources pack while the worker waits on the wire): they say where the seconds go, they do not
add up to the sync's wall time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import ray

from sync_runtime.schema.report import SyncReport
from sync_runtime.testing.cluster import DemoSetup, train_step
from sync_runtime.transfer import spans

Tallies = dict[str, dict[str, float]]
POSTPROCESS = (
    "apply.initialize",
    "apply.materialize",
    "apply.process_weights",
    "apply.restore_kernel",
    "apply.finalize",
    "apply.tied_and_scales",
)
"""The apply's spans that are vLLM's own post-load processing (all but the copy of staging)."""
BACKGROUND = ("worker.ws_join", "worker.ws_run")
"""The worker's calls that return before they ran (the engine serves meanwhile)."""


class SpanProbe:
    """Resets and collects the tallies of the proxy, the worker (local rank 0) and the sources."""

    def __init__(self, proxy: Any, sources: list[Any]) -> None:
        self.proxy, self.sources = proxy, sources

    def reset(self) -> None:
        self._collect()

    def collect(self, report: SyncReport) -> dict[str, Any]:
        got = self._collect()
        return {**got, "stages": report.stages.model_dump()}

    def _collect(self) -> dict[str, Tallies]:
        # the proxy first: reading the worker's tally is itself a call through the proxy
        proxy = ray.get(self.proxy.__ray_call__.remote(spans.take_from), timeout=120)
        worker = ray.get(self.proxy.ws_rank_call.remote(0, "ws_spans", ()), timeout=120)
        per_source = ray.get([h.__ray_call__.remote(spans.take_from) for h in self.sources], timeout=120)
        return {"proxy": proxy, "worker": worker, "sources": _merge(per_source), "driver": spans.take()}


def _merge(tallies: list[Tallies]) -> Tallies:
    """Per name, the slowest process's wall and CPU seconds (the sources run in parallel)."""
    out: Tallies = {}
    for t in tallies:
        for name, v in t.items():
            have = out.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0})
            have["wall_s"] = max(have["wall_s"], v["wall_s"])
            have["cpu_s"] = max(have["cpu_s"], v["cpu_s"])
            have["calls"] = max(have["calls"], v["calls"])
    return out


def _wall(t: Tallies, *names: str, prefix: str = "") -> float:
    if prefix:
        return sum(v["wall_s"] for k, v in t.items() if k.startswith(prefix))
    return sum(t[n]["wall_s"] for n in names if n in t)


def categories(b: dict[str, Any]) -> dict[str, float]:
    """One sync's seconds per category (see the module doc: they overlap)."""
    w, p, s, st = b["worker"], b["proxy"], b["sources"], b["stages"]
    return {
        "coordinator_discover_s": st["discover"],
        "coordinator_plan_s": st["plan"],
        "coordinator_connect_s": st["connect"],
        "coordinator_transfer_s": st["transfer"],
        "coordinator_verify_s": st["verify"],
        "coordinator_commit_s": st["commit"],
        "http_round_trips_s": _wall(p, prefix="http/"),
        "http_calls": sum(v["calls"] for k, v in p.items() if k.startswith("http/")),
        # update_weights returns after the worker ran the call (all but ws_join / ws_run, which
        # run in the background): what is left of the round trips is the control path's own cost
        "control_overhead_s": _wall(p, prefix="http/")
        - sum(v["wall_s"] for k, v in w.items() if k.startswith("worker.") and k not in BACKGROUND),
        "proxy_await_answers_s": _wall(p, prefix="proxy.await."),
        "worker_join_s": _wall(w, "worker.ws_join"),
        "worker_transfer_run_s": _wall(w, "worker.ws_run"),
        "wire_wait_s": _wall(w, "transfer.wire_wait"),
        "recv_land_checksum_s": _wall(w, "transfer.land_and_checksum"),
        "staging_alloc_s": _wall(w, "transfer.allocate_staging"),
        "txn_staged_checksums_s": _wall(w, "stage.checksum_all"),
        "commit_per_tensor_checksums_s": _wall(w, "commit.checksum_per_tensor"),
        "apply_s": _wall(w, "commit.apply"),
        "apply_copy_staged_s": _wall(w, "apply.copy_staged"),
        "apply_vllm_postprocess_s": _wall(w, *POSTPROCESS),
        "worker_commit_call_s": _wall(w, "worker.ws_commit"),
        "source_pack_checksum_s": _wall(s, "transfer.pack_and_checksum"),
        "source_wire_wait_s": _wall(s, "transfer.wire_wait"),
        "source_run_s": _wall(s, "transfer.rounds"),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median per category over the warm syncs."""
    cats = [categories(b) for b in runs]
    return {k: statistics.median(c[k] for c in cats) for k in cats[0]} if cats else {}


def lines(label: str, c: dict[str, float]) -> list[str]:
    if not c:
        return []
    return [
        f"breakdown ({label}, medians, overlapping): coordinator stages"
        f" discover {c['coordinator_discover_s']:.3f}"
        f" plan {c['coordinator_plan_s']:.3f} connect {c['coordinator_connect_s']:.3f}"
        f" transfer {c['coordinator_transfer_s']:.3f} verify {c['coordinator_verify_s']:.3f}"
        f" commit {c['coordinator_commit_s']:.3f}",
        f"  control: {c['http_calls']:.0f} HTTP calls {c['http_round_trips_s']:.3f} s (the control"
        f" path's own {c['control_overhead_s']:.3f} s, the rest the worker's calls); proxy waiting for"
        f" answers {c['proxy_await_answers_s']:.3f} s; worker ws_join {c['worker_join_s']:.3f} s",
        f"  transfer (worker): ws_run {c['worker_transfer_run_s']:.3f} s = wire wait {c['wire_wait_s']:.3f}"
        f" + land/checksum {c['recv_land_checksum_s']:.3f} + staging alloc {c['staging_alloc_s']:.3f}"
        f" (+ rest); sources: pack/checksum {c['source_pack_checksum_s']:.3f}, wire wait"
        f" {c['source_wire_wait_s']:.3f}",
        f"  commit (worker): ws_commit {c['worker_commit_call_s']:.3f} s = txn staged checksums"
        f" {c['txn_staged_checksums_s']:.3f} + per-tensor checksums {c['commit_per_tensor_checksums_s']:.3f}"
        f" + apply {c['apply_s']:.3f} (copy staged {c['apply_copy_staged_s']:.3f}, vLLM post-processing"
        f" {c['apply_vllm_postprocess_s']:.3f})",
    ]


MeasuredSync = Callable[[str], tuple[SyncReport, dict[str, Any]]]
"""Version -> (the sync's report, the bench's measures of it: wall, CPU by process group, ...)."""


def warm_syncs(
    setup: DemoSetup, probe: SpanProbe, versions: list[str], measured_sync: MeasuredSync
) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """One measured sync per version (the sources train a step before each, not timed), with its
    stage seconds and span breakdown; and each sync's (begin, end) on the monotonic clock."""
    warm, windows = [], []
    for v in versions:
        train_step(setup, v)
        probe.reset()
        begin = time.monotonic()
        report, measures = measured_sync(v)
        windows.append((begin, time.monotonic()))
        warm.append(
            {
                **measures,
                "plan_cached": report.plan_cached,
                "transfer_s": report.stages.transfer,
                "commit_s": report.stages.commit,
                "pause_s": report.replicas[0].pause_seconds if report.replicas else None,
                "breakdown": probe.collect(report),
            }
        )
    return warm, windows
