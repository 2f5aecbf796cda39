"""Delta syncs on a real Megatron-Core model: changed fraction, wire bytes and time vs a full sync.

This process trains a Megatron-Core GPT model (local spec, TP 1, CPU) whose parameters are fp32
(the main weights Megatron's mixed-precision optimizer keeps; init std 0.02, a trained model's
scale) with torch Adam at an RL-like learning rate; after each step the bf16 copy of every
parameter is what a sync moves (the model params Megatron casts from the main weights). Two
rank processes (gloo, loopback: one source, one destination replica) then sync each version
twice: as a delta from the previous one, and in full; both must leave the same bytes. Both
ranks start each timed sync together (a store barrier), so neither one's bookkeeping between
syncs (the destination hashes its committed tensors) is counted as the other's wire wait.

Links: loopback is a memory copy, where a delta's codec costs time and its saved bytes save
none. So the same syncs also run over shaped links (`--links`, Gbit/s): the bench re-runs itself
in a network namespace of its own (`unshare --net --map-root-user`; its traffic only) and puts a
token-bucket rate limit (`tc ... tbf`) on that namespace's loopback before each link's syncs.
Every link starts with a full sync, so each delta's base is on that link's destination.

Prints per step: changed fraction, wire bytes of the delta vs the full sync, wall and CPU
seconds of each (the slowest rank), the source's kept-copy write, peak RSS per rank; and the
planner's prediction for Kimi-K2 (256 -> 128 ranks) at a 3% change rate, from the wire ratio
the same encoder gives at 3% on bf16, against the floor of a full sync.

    make bench-delta
    make bench-delta ARGS="--steps 3 --lr 1e-6 --hidden 1024 --layers 4"
    make bench-delta ARGS="--phases --profile /tmp/delta-prof"   # where each rank's time goes
    make bench-delta ARGS="--links loopback"   # no namespace, no shaping
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan, spans
from sync_runtime.transfer import delta as delta_codec
from sync_runtime.transfer.delta_wire import KeptBits

KIMI = ("kimi-k2", "tp=8,pp=8,dp=4,ep=32,layers=8+8+8+8+8+7+7+7", "tp=16,ep=16,replicas=8")


def model_config(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 3 * hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256), "head_dim": 64, "vocab_size": vocab,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip


def train(config: dict[str, Any], steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """bf16 source tensors (Megatron layout names) of the initial model and after each step."""
    from sync_runtime.engines.megatron import MegatronSource
    from sync_runtime.testing.megatron_models import build_chunks, init_parallel, megatron_config
    from sync_runtime.testing.megatron_train import train_step

    # One rank: an in-process store, no port to find (one found free can be taken by then).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = ParallelSpec()
    init_parallel(spec, seed=0)
    chunks = build_chunks(config, megatron_config(config, spec, dtype=torch.float32, init_std=0.02))
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=lr)

    def bf16() -> dict[str, torch.Tensor]:
        return {n: t.detach().to(torch.bfloat16) for n, t in MegatronSource(chunks, config).tensors.items()}

    versions = [bf16()]
    for k in range(steps):
        train_step(chunks, optimizer, int(config["vocab_size"]), tied=False, seed=100 + k)
        versions.append(bf16())
    dist.destroy_process_group()
    return versions


def sync_rank(
    ctx: RankContext,
    plan: Any,
    versions: list[dict[str, torch.Tensor]] | None,
    dst: dict,
    steps: int,
    links: list[str],
    profile_dir: str | None = None,
) -> list:
    """Source (rank 0, `versions`) or destination (rank 1, `dst`: its initial tensors), every
    version over each link in turn. `profile_dir`: each sync's cProfile stats (rank{r}-{sync}.prof)."""
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=2,
        backend="gloo", timeout_s=300.0, group_name=ctx.group_name,
    )  # fmt: skip
    out: list[dict] = []
    for link in links:
        _barrier(group, f"{link}/idle")  # no sync in flight while the link changes
        if ctx.rank == 0:
            shape_loopback(link)
        _barrier(group, f"{link}/shaped")
        dest = DestinationWeights(dst, f"{link}/init", keep_staging=True) if versions is None else None
        kept, base = KeptBits(), ""
        for k in range(steps):
            for kind in ("full",) if k == 0 else ("delta", "full"):
                sources = versions[k] if versions is not None else None
                label = f"{link}/v{k}-{kind}"
                row = _one_sync(group, plan.for_rank(ctx.rank), sources, dest, kept, label,
                                base if kind == "delta" else None, profile_dir)  # fmt: skip
                out.append({**row, "link": link, "step": k, "kind": kind})
                base = label
    group.close()
    return out


def _one_sync(
    group: SyncGroup,
    program: Any,
    sources: dict[str, torch.Tensor] | None,
    dest: DestinationWeights | None,
    kept: KeptBits,
    label: str,
    delta_base: str | None,
    profile_dir: str | None,
) -> dict:
    """One timed sync (a delta from `delta_base`, or full), committed; its measurements."""
    if dest is not None:
        dest.begin(label)
    bases = ((1, delta_base),) if delta_base is not None else ()
    cfg = TransferConfig(timeout_s=300.0, delta_base=bases, keep_sent=True)
    _barrier(group, label)  # neither rank's bookkeeping of the last sync counts in this one
    spans.take()
    profiler = cProfile.Profile() if profile_dir else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    result = run_rank_plan(group, program, sources=sources, destination=dest, config=cfg,
                           kept=kept if sources is not None else None)  # fmt: skip
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    phases = spans.take()
    if profiler is not None:
        profiler.dump_stats(f"{profile_dir}/rank{group.rank}-{label.replace('/', '-')}.prof")
    assert result.ok, result.failure
    keep_s = 0.0
    if sources is not None:
        t = time.perf_counter()
        kept.record(sources, label)
        keep_s = time.perf_counter() - t
    digest = ""
    if dest is not None:
        dest.commit(label)
        h = hashlib.sha256()
        for name in sorted(dest.tensors):
            h.update(dest.tensors[name].view(torch.int16).numpy().tobytes())
        digest = h.hexdigest()
    return {
        "wall": wall, "cpu": cpu, "keep": keep_s, "digest": digest,
        "phases": {name: tally["wall_s"] for name, tally in phases.items()},
        "wire": result.wire_bytes, "full": result.send_bytes, "changed": result.delta_changed,
        "elements": result.delta_elements, "rss_mb": _rss_mb(),
    }  # fmt: skip


def shape_loopback(link: str) -> None:
    """Rate-limit this network namespace's loopback to `link` Gbit/s (token bucket, a 10 ms
    burst), or lift the limit for "loopback"."""
    if link == "loopback":
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
        return
    rate = float(link) * 1e9 / 8  # bytes per second
    burst = max(int(rate / 100), 256 * 1024)  # above loopback's 64 KiB MTU, as tbf requires
    cmd = ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{link}gbit",
           "burst", str(burst), "latency", "100ms"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def enter_network_namespace(links: list[str]) -> None:
    """Re-run this bench in a network namespace of its own when a link is to be shaped (a rate
    limit on the machine's loopback would slow everything else on it). Exits 2 if it cannot."""
    if links == ["loopback"] or os.environ.get("WS_BENCH_NETNS") == "1":
        return
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("tc") is None or shutil.which("ip") is None:
        print("bench-delta: shaped links need unshare, ip and tc (util-linux, iproute2); "
              "or run with --links loopback", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    os.environ["WS_BENCH_NETNS"] = "1"
    os.execv(unshare, [unshare, "--net", "--map-root-user", sys.executable, *sys.argv])


def bring_up_loopback() -> None:
    """A new network namespace's loopback starts down (the store and gloo need it)."""
    if os.environ.get("WS_BENCH_NETNS") != "1":
        return
    done = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True, check=False)
    if done.returncode:
        why = done.stderr.strip()
        print(f"bench-delta: cannot bring up the namespace's loopback: {why}", file=sys.stderr)
        sys.exit(2)


def _barrier(group: SyncGroup, label: str) -> None:
    """Both ranks start the timed sync together (the destination hashes its committed tensors
    after each sync: without this the source's wire wait would count that)."""
    key = f"bench/{label}"
    if group.store.add(key, 1) == 2:
        group.store.set(f"{key}/go", "1")
    group.store.wait([f"{key}/go"])


def _phases(row: dict) -> str:
    return ", ".join(f"{name.removeprefix('transfer.')} {wall:.3f}" for name, wall in row["phases"].items())


def _rss_mb() -> float:
    """This process's resident memory now (ru_maxrss is useless here: a spawned rank inherits the
    parent's peak across exec)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def kimi_prediction(ratio: float) -> tuple[float, float, float]:
    """(floor of a full sync, predicted full, predicted delta) for Kimi-K2 256 -> 128."""
    from sync_runtime.core.cost import LinkCost, bucket_arrays, floor_seconds_arrays, predict_seconds_arrays
    from sync_runtime.core.models import load_model_config
    from sync_runtime.core.plan import SyncPlan

    name, src, dst = KIMI
    manifest = build_manifest(load_model_config(name))
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    plan: SyncPlan = plan_sync(
        manifest, SideSpec("megatron", s, tuple(enumerate_ranks(s, Role.SOURCE))),
        [SideSpec("vllm", d, tuple(enumerate_ranks(d, Role.DESTINATION)))], PlannerConfig(),
    )  # fmt: skip
    cost, arrays = LinkCost(), bucket_arrays(plan)
    scaled = dataclasses.replace(arrays, nbytes=np.ceil(arrays.nbytes * ratio).astype(np.int64))
    return (
        floor_seconds_arrays(arrays, cost),
        predict_seconds_arrays(arrays, cost),
        predict_seconds_arrays(scaled, cost),
    )


def wire_ratio_at(fraction: float, n: int = 1 << 22) -> float:
    """Delta message bytes / dense bytes for bf16 with `fraction` of the elements changed at random."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = base.copy()
    new[rng.random(n) < fraction] ^= 1
    return delta_codec.encode(base.view(np.uint8), new.view(np.uint8), 2).nbytes / (2 * n)


def parse_links(text: str) -> list[str]:
    """Links from "loopback,10,1": loopback and rates in Gbit/s (positive numbers)."""
    links = [item.strip() for item in text.split(",") if item.strip()]
    for link in links:
        if link != "loopback":
            try:
                ok = float(link) > 0
            except ValueError:
                ok = False
            if not ok:
                why = f"{link!r}: a link is 'loopback' or a rate in Gbit/s (e.g. 10)"
                raise argparse.ArgumentTypeError(why)
    if not links:
        raise argparse.ArgumentTypeError("no link given")
    return links


def print_link(link: str, rows: list[tuple[dict, dict]], versions: int, phases: bool) -> list | None:
    """One link's table; (step, changed fraction, wire ratio, full s, delta s) per step, or None
    if a delta and the full sync of the same version left different bytes."""
    print(f"link: {link if link == 'loopback' else link + ' Gbit/s (tbf on the namespace loopback)'}")
    print(f"{'sync':<10} {'wire MB':>9} {'full MB':>9} {'wire/full':>9} {'changed':>8} {'wall s':>7} "
          f"{'cpu s src/dst':>14} {'keep s':>7}")  # fmt: skip
    for s, d in rows:
        changed = f"{s['changed'] / s['elements']:.4f}" if s["elements"] else "-"
        wall = max(s["wall"], d["wall"])
        cpu, name = f"{s['cpu']:6.3f}/{d['cpu']:<6.3f}", s["kind"] + str(s["step"])
        print(f"{name:<10} {s['wire'] / 1e6:9.2f} {s['full'] / 1e6:9.2f} {s['wire'] / s['full']:9.4f} "
              f"{changed:>8} {wall:7.3f} {cpu:>14} {s['keep']:7.3f}")  # fmt: skip
    if phases:
        for s, d in rows:
            name = s["kind"] + str(s["step"])
            print(f"{name:<10} phases, wall s: source {_phases(s)}; destination {_phases(d)}")
    out = []
    for k in range(1, versions):
        pair = [(s, d) for s, d in rows if s["step"] == k]  # (delta, full)
        same = pair[0][1]["digest"] == pair[1][1]["digest"]
        walls = [max(s["wall"], d["wall"]) for s, d in pair]
        wire = pair[0][0]["wire"] / pair[1][0]["wire"]
        print(f"step {k}: delta == full bit for bit: {same}; wire {wire:.4f}x, "
              f"time {walls[0] / walls[1]:.3f}x of the full sync")  # fmt: skip
        if not same:
            return None
        out.append((k, pair[0][0]["changed"] / pair[0][0]["elements"], wire, walls[1], walls[0]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--phases", action="store_true", help="print each sync's phases (wall s) per rank")
    parser.add_argument("--profile", metavar="DIR", help="write each rank's cProfile stats per sync to DIR")
    parser.add_argument("--links", default="loopback,10,4,1", type=parse_links,
                        help="loopback and link rates in Gbit/s, comma-separated (%(default)s)")  # fmt: skip
    args = parser.parse_args()
    enter_network_namespace(args.links)
    bring_up_loopback()
    torch.set_num_threads(1)
    config = model_config(args.hidden, args.layers, args.vocab)
    t = time.perf_counter()
    versions = train(config, args.steps, args.lr)
    nbytes = sum(v.numel() * 2 for v in versions[0].values())
    took = time.perf_counter() - t
    shape = f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
    print(f"model: {shape}: {nbytes / 1e6:.1f} MB bf16; "
          f"{args.steps} Adam steps, lr {args.lr:g}, fp32 main weights: {took:.1f} s")  # fmt: skip
    for k in range(1, len(versions)):
        moved = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in
                    zip(versions[k - 1].values(), versions[k].values(), strict=True))  # fmt: skip
        print(f"step {k}: {moved / (nbytes // 2):.4%} of bf16 elements changed (counted directly)")
    spec, manifest = ParallelSpec(), build_manifest(config)
    dcoord = enumerate_ranks(spec, Role.DESTINATION)[0]
    plan = plan_sync(
        manifest, SideSpec("megatron", spec, tuple(enumerate_ranks(spec, Role.SOURCE))),
        [SideSpec("vllm", spec, (dcoord,))], PlannerConfig(),
    )  # fmt: skip
    dshard = get_layout("vllm").shard(manifest, spec, dcoord)
    dst = {t.name: torch.zeros(t.shape, dtype=torch.bfloat16) for t in dshard.tensors}
    with LocalWorld(2) as world:
        outcomes = world.run(
            sync_rank,
            [
                (plan, versions, {}, len(versions), args.links, args.profile),
                (plan, None, dst, len(versions), args.links, args.profile),
            ],
            timeout_s=1800,
        )
    for o in outcomes:
        if o.error or o.exitcode is not None:
            print(o.error or f"rank {o.rank} died ({o.exitcode})", file=sys.stderr)
            return 1
    src, dest = outcomes[0].value, outcomes[1].value
    summary = []
    for link in args.links:
        on = [(s, d) for s, d in zip(src, dest, strict=True) if s["link"] == link]
        ratios = print_link(link, on, len(versions), args.phases)
        if ratios is None:
            return 1
        summary += [(link, *r) for r in ratios]
    print("summary, delta vs full sync of the same version (wall: the slower rank):")
    print(f"{'link':<10} {'step':>4} {'changed':>8} {'wire':>7} {'time':>7} {'full s':>7} {'delta s':>7}")
    for link, step, changed, wire, full_s, delta_s in summary:
        name = link if link == "loopback" else f"{link} Gbit/s"
        ratio = delta_s / full_s
        print(f"{name:<10} {step:>4} {changed:8.4f} {wire:6.4f}x {ratio:6.3f}x {full_s:7.3f} {delta_s:7.3f}")
    src_rss, dst_rss = max(s["rss_mb"] for s in src), max(d["rss_mb"] for d in dest)
    print(f"resident after a sync, max: source rank {src_rss:.0f} MB (holds {len(versions)} versions and the "
          f"kept copy, {nbytes / 1e6:.1f} MB each), destination rank {dst_rss:.0f} MB")  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"this process (training, fp32 weights and Adam state): peak RSS {peak:.0f} MB")
    ratio = wire_ratio_at(0.03)
    floor, full, predicted = kimi_prediction(ratio)
    print(f"Kimi-K2 256 -> 128 at 3% changed (wire ratio {ratio:.4f}): full sync floor {floor:.3f} s, "
          f"predicted full {full:.3f} s, delta {predicted:.3f} s ({predicted / floor:.3f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
