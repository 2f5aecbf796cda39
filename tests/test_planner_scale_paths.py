"""The planner's fast paths for large plans against plain references (issue 13, "Scale").

- source cells built once per shared shard equal cells built rank by rank, and a cell that names
  its one piece is read from that piece by every holder;
- the cost model in round slices equals a per-bucket reference, in any bucket order;
- light holder sets dealt from a heap choose what per-occupation argmin choices would;
- the lane schedule, forced onto small plans, keeps the planner's invariants, and its quality
  gate for mid-size plans falls back to the greedy schedule;
- the sliced counting sort and per-rank byte sums equal numpy's stable argsort and one bincount;
- numpy's huge-page advice is off while planning and the caller's setting restored after; glibc
  serves a large array freed and allocated again from memory it kept (no page faults);
- the collector is off while planning, and what planning leaves alive starts in the oldest
  generation (the first young collection after it would otherwise scan all of it).
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sync_runtime.core import cost as cost_model
from sync_runtime.core import memory
from sync_runtime.core.cost import BucketArrays, LinkCost
from sync_runtime.core.gc_pause import FROZEN_BY_HOST
from sync_runtime.core.layouts.base import Piece
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role
from sync_runtime.planner import PlannerConfig, columns, lanes
from sync_runtime.planner.refine import build_cells, build_shared_cells
from sync_runtime.runtime.hf_manifest import build_manifest
from tests.support.session_site import sitecustomize as session_site
from tests.test_planner_properties import Case, run_case, side

pytestmark = pytest.mark.unit


def _random_groups(rng: random.Random) -> list[tuple[list[int], list[Piece]]]:
    """Ranks split into groups (ascending, interleaved), each holding a few boxes of two tensors."""
    ranks = list(range(rng.randint(1, 12)))
    rng.shuffle(ranks)
    groups: list[tuple[list[int], list[Piece]]] = []
    while ranks:
        k = rng.randint(1, 4)
        take, ranks = ranks[:k], ranks[k:]
        boxes = [((lo, lo + 2), (0, 3)) for lo in rng.sample(range(0, 8, 2), rng.randint(1, 3))]
        pieces = [Piece(rng.choice("ab"), box, f"local{len(groups)}", box) for box in boxes]
        groups.append((sorted(take), pieces))
    return sorted(groups, key=lambda g: g[0][0])  # as the planner forms them: by first rank


@pytest.mark.parametrize("seed", range(30))
def test_shared_cells_equal_cells_built_rank_by_rank(seed: int) -> None:
    groups = _random_groups(random.Random(seed))
    per_rank = sorted(((r, p) for ranks, pieces in groups for r in ranks for p in pieces), key=lambda x: x[0])
    expected = build_cells(iter(per_rank))
    got = build_shared_cells(groups)
    assert got.keys() == expected.keys()
    for name, cells in expected.items():
        assert [c.box for c in got[name]] == [c.box for c in cells]
        assert [c.holders for c in got[name]] == [c.holders for c in cells]
        assert [c.ranks for c in got[name]] == [c.ranks for c in cells]
    # a cell that names its one piece: every holder reads that very object
    known = [c for cells in got.values() for c in cells if c.piece is not None]
    assert all(piece is c.piece for c in known for _, piece in c.holders)


def _reference_round_seconds(b: BucketArrays, c: LinkCost) -> list[float]:
    """The model of core/cost.py, bucket by bucket."""
    out = []
    for r in range(b.n_rounds):
        slots: dict[int, list[float]] = {}  # rank -> [nic sent, nic recv, nvl sent, nvl recv, messages]
        for i in np.flatnonzero(b.round_index == r).tolist():
            link = 2 if b.intra[i] else 0
            for rank, side_ in ((int(b.src_rank[i]), 0), (int(b.dst_rank[i]), 1)):
                slot = slots.setdefault(rank, [0.0] * 5)
                slot[link + side_] += float(b.nbytes[i])
                slot[4] += 1
        times = [
            max(s[0], s[1]) / c.nic_bytes_per_s
            + max(s[2], s[3]) / c.intra_node_bytes_per_s
            + s[4] * c.latency_s
            for s in slots.values()
        ]
        out.append(max(times, default=0.0))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_round_seconds_in_slices_equals_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    n, n_ranks, n_rounds = int(rng.integers(1, 300)), int(rng.integers(2, 9)), int(rng.integers(1, 20))
    buckets = BucketArrays(
        rng.integers(0, n_rounds, n),  # any order: the model sorts when it must
        rng.integers(0, n_ranks, n),
        rng.integers(0, n_ranks, n),
        rng.integers(1, 10_000, n),
        rng.random(n) < [0.0, 0.5, 1.0][seed % 3],  # no, some, only intra-node buckets
        n_ranks,
        n_rounds,
    )
    c = LinkCost(nic_bytes_per_s=1e3, intra_node_bytes_per_s=7e3, latency_s=0.25)
    monkeypatch.setattr(cost_model, "SLOTS_PER_PASS", int(rng.integers(1, 3 * n_ranks)))
    got = cost_model.round_seconds(buckets, c)
    assert got.tolist() == pytest.approx(_reference_round_seconds(buckets, c), rel=1e-12)


def _argmin_light(cols, ranks, cycle, n_lanes, busy, load):  # type: ignore[no-untyped-def]
    """The per-occupation numpy dealing that `lanes._light` replaced (the reference)."""
    starts, lengths, nbytes = cols[0], cols[2], cols[4]
    holders = np.asarray(ranks, dtype=np.int64)
    out = np.empty(len(starts), dtype=np.int64)
    for i in np.argsort(starts, kind="stable").tolist():
        idx = (starts[i] + np.arange(lengths[i])) % cycle
        for c in holders[np.argsort(load[holders], kind="stable")].tolist():
            if busy[c, idx].max() < n_lanes:
                busy[c, idx] += 1
                load[c] += nbytes[i]
                out[i] = c
                break
        else:
            return None
    return out


@pytest.mark.parametrize("seed", range(40))
def test_light_sets_dealt_as_by_argmin(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_ranks, cycle, n_lanes, m = (
        10,
        int(rng.integers(4, 30)),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 60)),
    )
    ranks = tuple(sorted(rng.choice(n_ranks, size=int(rng.integers(1, 6)), replace=False).tolist()))
    lengths = rng.integers(1, cycle + 1, m)
    cols = (rng.integers(0, cycle, m), np.zeros(m), lengths, np.zeros(m), rng.integers(1, 5, m) * 1000)
    busy = rng.integers(0, n_lanes + 1, (n_ranks, cycle))
    load = rng.integers(0, 3, n_ranks) * 1000  # ties between holders are common
    expected_load = load.copy()
    expected = _argmin_light(cols, ranks, cycle, n_lanes, busy.copy(), expected_load)
    got = lanes._light(cols, ranks, cycle, n_lanes, lanes._BusyRows(busy.copy()), load)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.tolist() == expected.tolist()
        assert load.tolist() == expected_load.tolist()


LANE_CASES = [
    ("tiny-llama", "megatron", "tp=2,pp=2,dp=2", "vllm", "tp=4,replicas=2"),
    ("tiny-qwen3-moe", "megatron", "tp=2,pp=2,dp=2,ep=4", "vllm", "tp=2,ep=2,replicas=2"),
    ("tiny-qwen3-moe", "megatron", "tp=2,pp=2,ep=2,etp=2,dp=2", "vllm", "tp=4"),
]


def _case(model: str, src_layout: str, src: str, dst_layout: str, dst: str) -> Case:
    return Case(
        build_manifest(load_model_config(model)),
        side(src_layout, ParallelSpec.parse(src), Role.SOURCE),
        (side(dst_layout, ParallelSpec.parse(dst), Role.DESTINATION),),
        PlannerConfig(bucket_bytes=2048, staging_budget_bytes=8192, max_fan_in=2),
    )


@pytest.mark.parametrize("spec", LANE_CASES)
def test_forced_lane_schedule_is_exact_and_gated(spec: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced (no size threshold, no quality gate) the lane schedule is taken and exact; gated
    with an unreachable bound the same plan falls back to greedy, still exact."""
    monkeypatch.setattr(lanes, "LANES_MIN_BUCKETS", 0)
    forced = run_case(_case(*spec))
    assert forced.stats["scheduler"] == "lanes"
    monkeypatch.setattr(lanes, "LANES_MIN_BUCKETS", 1)
    monkeypatch.setattr(lanes, "LANES_CHECKED_SPAN", 10**9)
    monkeypatch.setattr(lanes, "LANES_MAX_OVER_FLOOR", float("inf"))
    assert run_case(_case(*spec)).digest == forced.digest  # the gate passes: same plan
    monkeypatch.setattr(lanes, "LANES_MAX_OVER_FLOOR", 0.0)
    assert run_case(_case(*spec)).stats["scheduler"] == "greedy"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("slice_rows", [1, 7, 1 << 20])
@pytest.mark.parametrize("n_keys", [1, 3, 521, 1 << 15, 40_000])  # past 1 << 15: in slices
def test_grouped_equals_stable_argsort(
    seed: int, slice_rows: int, n_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(columns, "GROUP_SLICE", slice_rows)
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, n_keys, int(rng.integers(0, 300))).astype(np.int32)
    order, at = columns.grouped(keys, n_keys)
    assert order.tolist() == np.argsort(keys, kind="stable").tolist()
    assert at.tolist() == [0, *np.cumsum(np.bincount(keys, minlength=n_keys)).tolist()]
    if len(keys) > 1 and len(set(keys.tolist())) > 1:  # negative control: an unstable order differs
        assert order.tolist() != np.argsort(keys, kind="stable")[::-1].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_bytes_per_rank_in_slices_equals_one_bincount(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost_model, "SLOTS_PER_PASS", 5)
    rng = np.random.default_rng(seed)
    ranks = rng.integers(0, 9, 101).astype(np.int32)
    nbytes = rng.integers(1, 1 << 40, 101)
    got = cost_model.bytes_per_rank(ranks, nbytes, 9)
    want = [sum(int(b) for r, b in zip(ranks, nbytes, strict=True) if r == rank) for rank in range(9)]
    assert got.astype(np.int64).tolist() == want


@pytest.mark.skipif(memory._set_madvise_hugepage is None, reason="this numpy has no huge-page switch")
@pytest.mark.parametrize("caller", [True, False])
def test_hugepage_advice_is_off_while_planning_and_restored(caller: bool) -> None:
    switch = memory._set_madvise_hugepage
    assert switch is not None

    def advised() -> bool:
        was = switch(True)
        switch(was)
        return bool(was)

    before = switch(caller)
    try:
        with memory.hugepages_unadvised():
            assert advised() is False
            with memory.hugepages_unadvised():  # nested: the outer pass's setting comes back
                pass
            assert advised() is False
        assert advised() is caller
        with pytest.raises(RuntimeError), memory.hugepages_unadvised():
            raise RuntimeError("a failed pass restores it too")
        assert advised() is caller
    finally:
        switch(before)


GC_PROBE = """
import gc, json, sys, weakref
from sync_runtime.core.gc_pause import FROZEN_BY_HOST, gc_paused
class Node: pass
host_froze, enabled = sys.argv[1] == "frozen", sys.argv[2] == "enabled"
(gc.enable if enabled else gc.disable)()
if host_froze:
    heap = [[i] for i in range(2 * FROZEN_BY_HOST)]  # a host's long-lived objects, frozen by it
    gc.freeze()
before = gc.get_freeze_count()
with gc_paused():
    paused = not gc.isenabled()
    made = [[i] for i in range(1000)]  # tracked containers, made while paused
    cycle = Node(); cycle.me = cycle; dead = weakref.ref(cycle); del cycle  # garbage, made meanwhile
control = [[0]]  # made after the pass: young (the checks below can fail)
ids = lambda g: {id(o) for o in gc.get_objects(generation=g)}
print(json.dumps({
    "paused": paused, "enabled_after": gc.isenabled(), "frozen_before": before,
    "frozen_after": gc.get_freeze_count(), "made_in": [g for g in range(3) if id(made) in ids(g)],
    "made_young": any(id(m) in ids(0) for m in made), "control_young": id(control) in ids(0),
    "cycle_collected": dead() is None,
}))
"""


def _gc_probe(host_froze: bool, enabled: bool) -> dict:
    """In a plain interpreter: the test session's site module freezes this process's heap."""
    pythonpath = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": session_site.pythonpath_without_this_site(pythonpath)}
    args = ["frozen" if host_froze else "plain", "enabled" if enabled else "disabled"]
    out = subprocess.run(
        [sys.executable, "-c", GC_PROBE, *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_leaves_survivors_in_the_oldest_generation(enabled: bool) -> None:
    r = _gc_probe(host_froze=False, enabled=enabled)
    assert r["paused"] and r["enabled_after"] is enabled
    assert r["made_in"] == [2] and not r["made_young"] and r["control_young"]
    assert r["frozen_before"] < FROZEN_BY_HOST and r["frozen_after"] == 0  # CPython's own few too


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_keeps_a_heap_its_host_froze_frozen(enabled: bool) -> None:
    """A process that froze its heap (a trainer after building its model, as vLLM does once an
    engine has started) keeps it frozen across a pass (the plain case's unfreeze would leave 0)."""
    r = _gc_probe(host_froze=True, enabled=enabled)
    assert r["paused"] and r["enabled_after"] is enabled
    assert r["frozen_before"] > FROZEN_BY_HOST
    assert r["frozen_after"] >= r["frozen_before"] + 1000  # the host's heap and the pass's survivors
    assert r["made_in"] == [] and not r["made_young"] and r["control_young"]
    assert r["cycle_collected"]  # garbage made during the pass is not frozen with the survivors


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_large_blocks_come_back_from_the_heap_without_page_faults() -> None:
    def faults_of_a_fresh_array() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB: past glibc's largest mmap threshold
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del block
        return faults

    with memory.hugepages_unadvised():  # 4 KiB pages: the counts below are of pages
        assert memory.keep_large_blocks_on_heap() is True
        assert memory.keep_large_blocks_on_heap() is True  # once per process; asking again is free
        faults_of_a_fresh_array()  # the heap grows to hold it once
        assert faults_of_a_fresh_array() < 1000  # 16,384 pages if it were mapped afresh
