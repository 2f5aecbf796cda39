"""Transfer benchmark: the same bytes moved three ways, gloo on loopback, real processes.

(a) weightsync: the planner's plan executed by the transfer engine (checksum, send, receive,
    verify; large contiguous regions zero-copy, the rest packed; double-buffered), warm path:
    group and plan reused, and the destination keeps its staging buffers between syncs
    (`keep_staging=True`). (a0) the same with fresh staging each sync (the default), whose
    first-touch page faults on CPU cost about as much as the transfer.
(b) naive: source rank 0 gathers every full canonical tensor from the source ranks, then sends
    it to every destination rank, which slices out its shard (the rank-0 funnel many RL
    frameworks use).
(c) transport: each destination rank receives its total plan bytes as one contiguous message
    from one source rank (no packing, no checksums): what loopback gloo can do at best.

Then the destination staging policies side by side (`spec.transport.staging`): host, device,
inplace, each a full sync plus its commit, with fresh staging every sync, and the extra memory
the destination's staging allocated next to the live weights ("device" tier) and in host
memory (`DestinationWeights.meter`). On this CPU-only bench both tiers are the same RAM: the
figures say where each policy puts its buffers; on CUDA the device tier is GPU memory.

Each measurement: a barrier, then the method; the time is the slowest rank's; median of
--repeats runs after one warm-up, the methods interleaved (machine load drifts). Prints a
table; writes nothing.

    make bench-transfer                 # tiny and mid-size presets
    make bench-transfer ARGS=--quick    # tiny only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from sync_runtime.core.layouts.base import Piece
from sync_runtime.core.topology import Role
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import Scenario
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan
from sync_runtime.transfer.buffers import box_slices

TIMEOUT_S = 300.0
POLICIES = ("host", "device", "inplace")
# A llama whose heads split 3 ways and 2 ways (nh=24, nkv=6), about 400 MB in bf16.
MID_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1536,
    "intermediate_size": 4608, "num_hidden_layers": 4, "num_attention_heads": 24,
    "num_key_value_heads": 6, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": False,
}  # fmt: skip
TINY_LLAMA_12 = {**MID_LLAMA, "hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 12,
                 "head_dim": 8, "vocab_size": 1000}  # fmt: skip

CASES: list[tuple[str, str, object, str, str]] = [
    # (size, case, model, source, destination)
    ("tiny", "equal tp2->tp2", "tiny-llama", "tp=2", "tp=2"),
    ("tiny", "tp2->tp4", "tiny-llama", "tp=2", "tp=4"),
    ("tiny", "tp3->tp2", TINY_LLAMA_12, "tp=3", "tp=2"),
    ("tiny", "ep2->ep2 (moe)", "tiny-qwen3-moe", "tp=2,ep=2", "tp=2,ep=2"),
    ("mid", "equal tp2->tp2", "mid-qwen3-moe", "tp=2", "tp=2"),
    ("mid", "tp4->tp2", "mid-qwen3-moe", "tp=4", "tp=2"),
    ("mid", "tp3->tp2", MID_LLAMA, "tp=3", "tp=2"),
    ("mid", "ep2->ep2 (moe)", "mid-qwen3-moe", "tp=2,ep=2", "tp=2,ep=2"),
]


def _random_like(shard) -> dict[str, torch.Tensor]:
    """Random bytes in the shard's shapes: timing does not depend on values, and this is fast."""
    out = {}
    for t in shard.tensors:
        bits = torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16)
        out[t.name] = bits.view(torch.bfloat16)
    return out


@dataclass(slots=True)
class _Rank:
    ctx: RankContext
    scenario: Scenario
    group: SyncGroup
    role: Role
    local: dict[str, torch.Tensor]
    n_src: int


def _barrier(r: _Rank) -> None:
    r.group.backend.barrier().wait()


def _method_plan(r: _Rank, plan, dest: DestinationWeights | None, staging: str = "host") -> float:
    rank_plan = plan.for_rank(r.ctx.rank)
    config = TransferConfig(timeout_s=TIMEOUT_S, staging=staging)
    if dest is not None:
        dest.begin("bench")
    _barrier(r)
    start = time.perf_counter()
    result = run_rank_plan(r.group, rank_plan, sources=r.local if r.role is Role.SOURCE else None,
                           destination=dest, config=config)  # fmt: skip
    elapsed = time.perf_counter() - start
    if not result.ok:
        raise RuntimeError(result.failure.message if result.failure else "failed")
    if dest is not None:
        dest.commit()
    return elapsed


def _cover(r: _Rank) -> dict[str, list[tuple[int, Piece]]]:
    """Per canonical tensor, one (source rank, piece) per distinct region: what rank 0 gathers."""
    cover: dict[str, dict[tuple, tuple[int, Piece]]] = {}
    for src in range(r.n_src):
        for p in r.scenario.shard(src)[1].pieces:
            cover.setdefault(p.tensor, {}).setdefault(p.canon_box, (src, p))
    return {name: list(regions.values()) for name, regions in cover.items()}


def _method_naive(
    r: _Rank, cover: dict[str, list[tuple[int, Piece]]], dst_pieces: dict[str, list[Piece]]
) -> float:
    pg, rank = r.group.backend, r.ctx.rank
    manifest = r.scenario.manifest()
    dst_ranks = range(r.n_src, r.scenario.world_size)
    _barrier(r)
    start = time.perf_counter()
    for ti, meta in enumerate(manifest.tensors):
        regions = cover[meta.name]
        if rank == 0:
            full = torch.empty(meta.shape, dtype=torch.bfloat16)
            by_src: dict[int, list[Piece]] = {}
            for src, p in regions:
                by_src.setdefault(src, []).append(p)
            for p in by_src.pop(0, []):
                full[box_slices(p.canon_box)] = r.local[p.local_name][box_slices(p.local_box)].reshape(
                    full[box_slices(p.canon_box)].shape)  # fmt: skip
            recvs = []
            for src, pieces in by_src.items():
                buf = torch.empty(sum(_numel(p) for p in pieces), dtype=torch.bfloat16)
                recvs.append((pg.recv([buf], src, ti), buf, pieces))
            for work, buf, pieces in recvs:
                work.wait()
                off = 0
                for p in pieces:
                    region = full[box_slices(p.canon_box)]
                    region.copy_(buf[off : off + region.numel()].view(region.shape))
                    off += region.numel()
            for w in [pg.send([full], d, ti) for d in dst_ranks]:
                w.wait()
        elif r.role is Role.SOURCE:
            mine = [p for src, p in regions if src == rank]
            if mine:
                buf = torch.cat([r.local[p.local_name][box_slices(p.local_box)].reshape(-1) for p in mine])
                pg.send([buf], 0, ti).wait()
        else:
            full = torch.empty(meta.shape, dtype=torch.bfloat16)
            pg.recv([full], 0, ti).wait()
            for p in dst_pieces.get(meta.name, []):
                region = r.local[p.local_name][box_slices(p.local_box)]
                region.copy_(full[box_slices(p.canon_box)].reshape(region.shape))
    return time.perf_counter() - start


def _numel(p: Piece) -> int:
    return _box_numel(p.canon_box)


def _method_transport(r: _Rank, plan, bufs: dict[int, torch.Tensor]) -> float:
    """Destination d receives its plan bytes in one message from source (d - n_src) % n_src."""
    pg = r.group.backend
    _barrier(r)
    start = time.perf_counter()
    if r.role is Role.SOURCE:
        works = [pg.send([buf], d, 7) for d, buf in bufs.items()]
    else:
        works = [pg.recv([buf], peer, 7) for peer, buf in bufs.items()]
    for w in works:
        w.wait()
    return time.perf_counter() - start


def _transport_buffers(r: _Rank, plan) -> dict[int, torch.Tensor]:
    recv_bytes = {d: sum(b.nbytes for rnd in plan.rounds for b in rnd.buckets if b.dst_rank == d)
                  for d in range(r.n_src, r.scenario.world_size)}  # fmt: skip
    rank = r.ctx.rank
    if r.role is Role.SOURCE:
        mine = {d: n for d, n in recv_bytes.items() if (d - r.n_src) % r.n_src == rank}
        return {d: torch.empty(n, dtype=torch.uint8) for d, n in mine.items()}
    return {(rank - r.n_src) % r.n_src: torch.empty(recv_bytes[rank], dtype=torch.uint8)}


def bench_rank(ctx: RankContext, scenario: Scenario, repeats: int) -> dict[str, list[float]]:
    plan = scenario.plan()
    role, shard = scenario.shard(ctx.rank)
    group = SyncGroup.connect(store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank,
                              world_size=scenario.world_size, backend="gloo", timeout_s=TIMEOUT_S,
                              group_name=ctx.group_name)  # fmt: skip
    n_src = len(scenario.sides()[0].coords)
    r = _Rank(ctx, scenario, group, role, _random_like(shard), n_src)
    dest = DestinationWeights(r.local, keep_staging=True) if role is Role.DESTINATION else None
    fresh = DestinationWeights(dict(r.local)) if role is Role.DESTINATION else None
    cover = _cover(r)
    dst_pieces: dict[str, list[Piece]] = {}
    for p in shard.pieces if role is Role.DESTINATION else ():
        dst_pieces.setdefault(p.tensor, []).append(p)
    tbufs = _transport_buffers(r, plan)
    methods = {
        "plan": lambda: _method_plan(r, plan, dest),
        "plan0": lambda: _method_plan(r, plan, fresh),
        "naive": lambda: _method_naive(r, cover, dst_pieces),
        "transport": lambda: _method_transport(r, plan, tbufs),
    }
    policies = {p: DestinationWeights(dict(r.local), policy=p) if dest else None for p in POLICIES}
    for p, pdest in policies.items():
        methods[p] = lambda p=p, pdest=pdest: _method_plan(r, plan, pdest, staging=p)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        fn()  # warm-up: first-touch allocations, checksum tables, gloo pair buffers
    for _ in range(repeats):
        for name, fn in methods.items():
            times[name].append(fn())
    group.close()
    for p, pdest in policies.items():  # peak staging bytes per tier over the whole run, this rank
        times[f"{p}:device"] = [float(pdest.meter.peak["device"]) if pdest else 0.0]
        times[f"{p}:host"] = [float(pdest.meter.peak["host"]) if pdest else 0.0]
    return times


def _plan_bytes(scenario: Scenario) -> tuple[int, int]:
    plan = scenario.plan()
    return sum(b.nbytes for rnd in plan.rounds for b in rnd.buckets), len(plan.rounds)


def _naive_wire_bytes(scenario: Scenario) -> int:
    """Bytes (b) puts on links: regions rank 0 lacks (gather) plus the full model per destination."""
    n_src = len(scenario.sides()[0].coords)
    manifest = scenario.manifest()
    own = {(p.tensor, p.canon_box) for p in scenario.shard(0)[1].pieces}
    regions = {(p.tensor, p.canon_box) for r in range(n_src) for p in scenario.shard(r)[1].pieces}
    gather = sum(_box_numel(box) * 2 for t, box in regions - own)
    return gather + manifest.nbytes * (scenario.world_size - n_src)


def _box_numel(box: tuple) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.quick or c[0] == "tiny"]
    scenarios = [Scenario(model, src, dst) for _, _, model, src, dst in cases]
    pool = max(s.world_size for s in scenarios)
    header = (f"{'size':5} {'case':16} {'MB':>7} {'b MB':>7} {'rnds':>4} {'a s':>7} {'a0 s':>7} "
              f"{'b s':>7} {'c s':>7} {'a GB/s':>7} {'c GB/s':>7} "
              f"{'a/b':>5} {'a/c':>5} {'a0/b':>5} {'a0/c':>5}")  # fmt: skip
    threads = max(1, (os.cpu_count() or 1) // pool)
    print(
        f"gloo loopback, {os.cpu_count()} cores, {pool} rank processes with {threads} torch thread(s) each;"
    )
    print(
        f"median of {args.repeats} runs after a warm-up; time = slowest rank; MB = plan bytes (a and c move"
    )
    print("these; b moves 'b MB'). a/b and a/c are time ratios; GB/s = plan bytes / time.")
    print("a: staging kept between syncs (keep_staging=True); a0: fresh staging each sync (default).")
    print("Targets: a/b <= 0.5 when TP differs; a/c <= 1.43 (a >= 0.7 of c) for mid.")
    print(header)
    policy_rows = []
    with LocalWorld(pool) as world:
        for (size, case, *_), scenario in zip(cases, scenarios, strict=True):
            nbytes, rounds = _plan_bytes(scenario)
            outcomes = world.run(bench_rank, [(scenario, args.repeats)] * scenario.world_size, TIMEOUT_S * 3)
            failed = [o for o in outcomes if o.error or o.exitcode is not None]
            if failed:
                print(f"{size:5} {case:16} FAILED: {failed[0]}")
                continue
            med = {m: statistics.median(max(o.value[m][i] for o in outcomes) for i in range(args.repeats))
                   for m in ("plan", "plan0", "naive", "transport")}  # fmt: skip
            gbps = {m: nbytes / t / 1e9 for m, t in med.items()}
            a, a0, b, c = med["plan"], med["plan0"], med["naive"], med["transport"]
            wire = _naive_wire_bytes(scenario) / 1e6
            print(f"{size:5} {case:16} {nbytes / 1e6:7.1f} {wire:7.1f} {rounds:4d} "
                  f"{a:7.3f} {a0:7.3f} {b:7.3f} {c:7.3f} {gbps['plan']:7.2f} {gbps['transport']:7.2f} "
                  f"{a / b:5.2f} {a / c:5.2f} {a0 / b:5.2f} {a0 / c:5.2f}", flush=True)  # fmt: skip
            policy_rows.append(_policy_row(size, case, scenario, outcomes, args.repeats))
    _print_policies(policy_rows)
    return 0


def _policy_row(size: str, case: str, scenario: Scenario, outcomes, repeats: int) -> str:
    """Time (slowest rank, median) and the largest destination rank's extra staging bytes."""
    n_src = len(scenario.sides()[0].coords)
    dests = [o.value for o in outcomes[n_src:]]
    weights = max(
        sum(math.prod(t.shape) * 2 for t in scenario.shard(r)[1].tensors) for r in range(n_src, len(outcomes))
    )
    cells = []
    for p in POLICIES:
        t = statistics.median(max(o.value[p][i] for o in outcomes) for i in range(repeats))
        dev = max(d[f"{p}:device"][0] for d in dests) / 1e6
        host = max(d[f"{p}:host"][0] for d in dests) / 1e6
        cells.append(f"{t:7.3f} {dev:8.1f} {host:8.1f}")
    return f"{size:5} {case:16} {weights / 1e6:8.1f} " + " ".join(cells)


def _print_policies(rows: list[str]) -> None:
    print()
    print("Destination staging policies: s = sync + commit (slowest rank, median); dev/host MB =")
    print("peak extra staging bytes of the largest destination rank next to its live weights (dev)")
    print("and in host memory (host); 'w MB' = that rank's weights. Fresh staging every sync.")
    head = " ".join(f"{p + ' s':>7} {p[:4] + ' dev':>8} {p[:4] + ' hst':>8}" for p in POLICIES)
    print(f"{'size':5} {'case':16} {'w MB':>8} {head}")
    for row in rows:
        print(row)


if __name__ == "__main__":
    sys.exit(main())
