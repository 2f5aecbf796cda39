"""Scale benchmark (`make bench-scale`): plan, then cut and pickle every rank's program.

Each case runs in a fresh process (`--child NAME`), so its peak memory (ru_maxrss) is its own.
Figures per case: CPU seconds of planning and of all per-rank programs (cut in batches by
`SyncPlan.rank_plans`, each pickled on its own), peak memory, the largest rank program's pickled
bytes against a pickle of just its transfers (and the largest such ratio over every rank, or for
cases over 1,024 ranks a sample of both sides: every 97th, the largest sender and receiver), wire
bytes against the lower bound, send max/mean and predicted against floor. CPU time, not wall
time: the machine is shared. Prints only; exits 0 either way (a benchmark, not a test).
Usage: python bench/scale_bench.py [--only NAME] [--ranks N]  (--ranks: programs of N ranks only)
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import subprocess
import sys
import time
import tracemalloc

CASES = {
    "kimi-k2-384": (
        "kimi-k2",
        "tp=8,pp=8,dp=4,ep=32,layers=8+8+8+8+8+7+7+7",
        "tp=16,ep=16,replicas=8",
        5.0,
        None,
    ),
    "kimi-k2-8192-4096": (
        "kimi-k2",
        "tp=8,pp=16,dp=64,ep=64,layers=" + "+".join(["4"] * 13 + ["3"] * 3),
        "tp=16,ep=16,replicas=256",
        10.0,
        2.0,
    ),
}
"""name: (model, source, destination, target CPU seconds, target peak GiB or None)."""


EVERY_RANK_UP_TO = 1024
"""Cases up to this many ranks check every rank's program against its transfers, larger ones a
sample (unpacking and pickling one rank's transfers takes ~50 ms)."""


def _transfers_bytes(rank_plan: object) -> int:
    """Pickled size of the rank's transfers alone: the floor a program's size is compared with."""
    ts = [t for side in (rank_plan.sends, rank_plan.recvs) for r in side for b in r for t in b.transfers]  # type: ignore[attr-defined]
    return len(pickle.dumps(ts, protocol=pickle.HIGHEST_PROTOCOL))


def _programs(plan: object, n_ranks: int) -> dict:
    """Cut (in batches, `rank_plans`) and pickle every rank's program; the largest one's figures,
    and the largest ratio of a program to its transfers over a sample of ranks."""
    started = time.process_time()
    sizes = []
    for program in plan.rank_plans(range(n_ranks)):  # type: ignore[attr-defined]
        blob = pickle.dumps(program, protocol=pickle.HIGHEST_PROTOCOL)
        sizes.append(len(blob))
    seconds = time.process_time() - started
    largest = max(range(n_ranks), key=sizes.__getitem__, default=0)
    rank_plan = plan.for_rank(largest)  # type: ignore[attr-defined]
    blob = pickle.dumps(rank_plan, protocol=pickle.HIGHEST_PROTOCOL)
    tracemalloc.start()
    received = pickle.loads(blob)
    participant_peak = tracemalloc.get_traced_memory()[1]
    # What the rank's transfer engine then walks: every bucket and transfer as objects.
    received.sends, received.recvs  # noqa: B018 (built on first access)
    unpacked_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del received
    # Rows blocks are per side and shared, so a sender's names table could outgrow its needs:
    # check the ratio on every rank, or on a sample covering both sides, the largest sender and
    # receiver included.
    n_src = sum(1 for r in plan.ranks if r.role.name == "SOURCE")  # type: ignore[attr-defined]
    n_src = min(n_src, n_ranks)
    sample = set(range(0, n_ranks, 1 if n_ranks <= EVERY_RANK_UP_TO else 97))
    for lo, hi in ((0, n_src), (n_src, n_ranks)):
        if hi > lo:
            sample.add(max(range(lo, hi), key=sizes.__getitem__))
    worst = (0.0, 0)
    for rank in sorted(sample):
        floor = _transfers_bytes(plan.for_rank(rank))  # type: ignore[attr-defined]
        if floor:
            worst = max(worst, (sizes[rank] / floor, rank))
    return {
        "programs_cpu_s": seconds,
        "programs_pickled_total": sum(sizes),
        "largest_rank": largest,
        "largest_program_bytes": sizes[largest] if sizes else 0,
        "largest_transfers_bytes": _transfers_bytes(rank_plan),
        "participant_unpickle_peak_bytes": participant_peak,
        "participant_unpacked_peak_bytes": unpacked_peak,
        "sampled_ranks": len(sample),
        "sampled_max_ratio": worst[0],
        "sampled_max_ratio_rank": worst[1],
    }


def child(name: str, ranks: int | None) -> dict:
    from sync_runtime.cli.main import build_parser, sync_inputs
    from sync_runtime.planner import plan_sync

    model, src, dst, _, _ = CASES[name]
    args = build_parser(["plan"]).parse_args(["plan", "--model", model, "--src", src, "--dst", dst])
    inputs = sync_inputs(args)
    started = time.process_time()
    plan = plan_sync(inputs.manifest, inputs.source, inputs.destinations, inputs.config)
    plan_s = time.process_time() - started
    s = plan.stats
    out = {k: s[k] for k in ("transfers", "buckets", "rounds", "wire_bytes", "lower_bound_bytes")}
    out.update(
        plan_cpu_s=plan_s,
        send_max_mean=s["max_send_bytes"] / s["mean_send_bytes"],
        predicted_s=s["predicted_seconds"],
        floor_s=s["floor_seconds"],
        ranks=len(plan.ranks),
        plan_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    out.update(_programs(plan, min(ranks or len(plan.ranks), len(plan.ranks))))
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def report(name: str, r: dict) -> None:
    _, src, dst, target_s, target_gib = CASES[name]
    total = r["plan_cpu_s"] + r["programs_cpu_s"]
    gib = r["peak_rss"] / 2**30
    ok = total <= target_s and (target_gib is None or gib <= target_gib)
    print(f"== {name}: {src} -> {dst} ({r['ranks']:,} ranks)")
    print(f"  transfers {r['transfers']:,}  buckets {r['buckets']:,}  rounds {r['rounds']:,}")
    print(f"  CPU s: plan {r['plan_cpu_s']:.2f} + all programs {r['programs_cpu_s']:.2f} = {total:.2f}")
    print(
        f"  peak memory (coordinator, ru_maxrss): {gib:.2f} GiB "
        f"(after planning {r['plan_peak_rss'] / 2**30:.2f})"
    )
    print(
        f"  largest rank program (rank {r['largest_rank']}): {r['largest_program_bytes']:,} B pickled vs "
        f"{r['largest_transfers_bytes']:,} B for its transfers alone "
        f"({r['largest_program_bytes'] / max(1, r['largest_transfers_bytes']):.2f}x); "
        f"unpickling peak {r['participant_unpickle_peak_bytes'] / 2**20:.1f} MiB, "
        f"unpacked into buckets and transfers {r['participant_unpacked_peak_bytes'] / 2**20:.1f} MiB "
        "(tracemalloc, on the participant)"
    )
    n = r["sampled_ranks"]
    which = f"all {n}" if n == r["ranks"] else f"{n} sampled"
    print(
        f"  program / its transfers, largest over {which} ranks (both sides): "
        f"{r['sampled_max_ratio']:.2f}x (rank {r['sampled_max_ratio_rank']})"
    )
    print(f"  all programs pickled: {r['programs_pickled_total'] / 2**20:.1f} MiB")
    wire = (
        "= lower bound"
        if r["wire_bytes"] == r["lower_bound_bytes"]
        else f"!= lower bound {r['lower_bound_bytes']:,}"
    )
    print(f"  wire bytes {r['wire_bytes']:,} {wire}")
    ratio = r["predicted_s"] / r["floor_s"]
    print(
        f"  send max/mean {r['send_max_mean']:.3f}  predicted {r['predicted_s']:.3f} s "
        f"vs floor {r['floor_s']:.3f} s ({ratio:.3f}x)"
    )
    limit = f"<= {target_s} s CPU" + (f", <= {target_gib} GiB" if target_gib else "")
    print(f"  target {limit}: {'met' if ok else 'MISSED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES))
    parser.add_argument("--ranks", type=int, help="cut programs for the first N ranks only")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.ranks)))
        return 0
    for name in CASES:
        if args.only and name != args.only:
            continue
        argv = [sys.executable, __file__, "--child", name] + (
            ["--ranks", str(args.ranks)] if args.ranks else []
        )
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"== {name}: failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
            continue
        report(name, json.loads(out.stdout.splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
