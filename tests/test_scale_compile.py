"""Every rank's program compiled in batches (`SyncPlan.rank_plans`) equals the one-rank cut
(`for_rank`) byte for byte, and both equal the reference cut of the full plan.

Batches are forced small (a few transfer rows) so that rank boundaries fall inside and between
batches; the cases cover relay copies, cells whose holders store them under different names
(tied embeddings) and sources with leading local dims (vLLM's fused experts as the source). The
holder index's two lookups (dense table, sorted keys) agree with a dict. Rows blocks shared by
ranks (from the cache) pickle as blocks built afresh. A perturbed program (a moved box, reversed
names, a transfer pointing at another transfer's row) must fail the comparison. A receiver's
block (shared by every replica at its position) travels compressed and inflates to the same rows;
a damaged one is refused.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sync_runtime.core.block_wire import HEAD
from sync_runtime.core.models import load_model_config
from sync_runtime.core.packed import PackedProgram, PackedRows, PackedSide, compressed
from sync_runtime.core.plan import RankPlan, SyncPlan
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync, tables
from sync_runtime.planner.blocks import BlockCache
from sync_runtime.planner.program import CompactPrograms
from sync_runtime.planner.tables import HolderIndex
from sync_runtime.runtime.hf_manifest import build_manifest
from tests.test_scale_programs import CASES, reference_cut

pytestmark = pytest.mark.unit


def _plan(case: tuple[str, str, str, str, str], bucket: int, staging: int, relay: str) -> SyncPlan:
    model, src_layout, src, dst_layout, dst = case
    manifest = build_manifest(load_model_config(model))
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    source = SideSpec(src_layout, s, tuple(enumerate_ranks(s, Role.SOURCE, 4)))
    dest = SideSpec(dst_layout, d, tuple(enumerate_ranks(d, Role.DESTINATION, 4)))
    config = PlannerConfig(bucket_bytes=bucket, staging_budget_bytes=staging, relay=relay)  # type: ignore[arg-type]
    return plan_sync(manifest, source, [dest], config)


COMPILE_CASES = [(m, "megatron", s, "vllm", d) for m, s, d in CASES] + [
    ("tiny-qwen3-moe", "vllm", "tp=2,ep=2,replicas=2", "megatron", "tp=2,pp=2,ep=2"),
]


def _programs(plan: SyncPlan) -> CompactPrograms:
    fresh = pickle.loads(pickle.dumps(plan))  # not materialised: nothing cached from `rounds`
    programs = fresh._programs
    assert isinstance(programs, CompactPrograms)
    return programs


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(COMPILE_CASES),
    bucket=st.sampled_from([512, 2048, 1 << 20]),
    staging=st.sampled_from([4096, 16384, 1 << 22]),
    relay=st.sampled_from(["off", "on"]),
    batch=st.sampled_from([1, 7, 100, 1 << 19]),
)
def test_batched_programs_equal_the_single_and_reference_cuts(
    case: tuple[str, str, str, str, str], bucket: int, staging: int, relay: str, batch: int
) -> None:
    plan = _plan(case, bucket, staging, relay)
    programs = _programs(plan)
    n = len(plan.ranks)
    batched = list(programs.rank_plans(range(n), plan.digest, chunk_transfers=batch))
    assert [p.rank for p in batched] == list(range(n))
    for rank, program in enumerate(batched):
        single = programs.rank_plan(rank, plan.digest)
        assert pickle.dumps(program) == pickle.dumps(single)  # same arrays and names table
        assert program == reference_cut(plan, rank)
    # the chunking's per-rank transfer counts (from pairs where no bucket is relayed)
    moved = [sum(len(b.transfers) for side in (p.sends, p.recvs) for r in side for b in r) for p in batched]
    assert programs._rank_transfers() == moved[: programs.n_ranks]  # ranks past it: no work
    assert not any(moved[programs.n_ranks :])


def test_any_rank_order_and_ranks_without_work() -> None:
    plan = _plan(COMPILE_CASES[2], 2048, 16384, "on")
    programs = _programs(plan)
    n = len(plan.ranks)
    ranks = [n + 2, *range(n - 1, -1, -2), 0, 0, n]  # reversed, repeated, past the last rank
    got = list(programs.rank_plans(ranks, plan.digest, chunk_transfers=5))
    assert [p.rank for p in got] == ranks
    for rank, program in zip(ranks, got, strict=True):
        assert pickle.dumps(program) == pickle.dumps(programs.rank_plan(rank, plan.digest))
        if rank >= n:
            assert not any(program.sends) and not any(program.recvs)
        else:
            assert program == reference_cut(plan, rank)
    whole = list(plan.rank_plans())
    assert whole == [plan.for_rank(rank) for rank in range(n)]


def _packed(program: RankPlan) -> PackedProgram:
    packed = program._packed
    assert packed is not None
    return packed


def _with_recvs(program: RankPlan, recvs: PackedSide) -> RankPlan:
    changed = dataclasses.replace(_packed(program), recvs=recvs)
    return RankPlan(program.rank, program.digest, packed=changed)


def _moved(program: RankPlan) -> RankPlan:
    """`program` with one received transfer's destination box shifted by one (in its block)."""
    packed = _packed(program)
    side = packed.recvs
    transfers = side.rows.transfers.copy()
    transfers[side.index[0], -2 * packed.width] += 1
    rows = PackedRows(transfers, side.rows.nbytes, side.rows.names)
    return _with_recvs(program, PackedSide(side.buckets, side.index, rows))


def _renamed(program: RankPlan) -> RankPlan:
    """`program` with its received rows' names table reversed."""
    side = _packed(program).recvs
    rows = PackedRows(side.rows.transfers, side.rows.nbytes, side.rows.names[::-1])
    return _with_recvs(program, PackedSide(side.buckets, side.index, rows))


def _aliased(program: RankPlan) -> RankPlan:
    """`program` with one received transfer pointing at another transfer's row (shared rows
    where they must not be)."""
    side = _packed(program).recvs
    index = side.index.copy()
    other = int(np.flatnonzero(index != index[0])[0])
    index[other] = index[0]
    return _with_recvs(program, PackedSide(side.buckets, index, side.rows))


def _shifted(program: RankPlan) -> RankPlan:
    """`program` with its first sent bucket starting one row later in its sender's block."""
    side = _packed(program).sends
    assert side.runs
    index = side.index.copy()
    index[0] += 1 if index[0] + 1 + side.buckets[0, 4] <= len(side.rows.transfers) else -1
    sends = dataclasses.replace(side, index=index)
    return RankPlan(program.rank, program.digest, packed=dataclasses.replace(_packed(program), sends=sends))


@pytest.mark.parametrize("case", COMPILE_CASES[:3] + COMPILE_CASES[-1:])
def test_a_perturbed_batched_program_fails_the_comparison(case: tuple[str, str, str, str, str]) -> None:
    plan = _plan(case, 2048, 16384, "off")
    rank = len(plan.ranks) - 1  # a destination: it receives
    program = next(iter(_programs(plan).rank_plans([rank], plan.digest, chunk_transfers=3)))
    assert program == reference_cut(plan, rank)
    assert len(_packed(program).recvs.index) > 1
    for bad in (_moved(program), _renamed(program), _aliased(program)):
        assert bad != reference_cut(plan, rank)
    sender = next(iter(_programs(plan).rank_plans([0], plan.digest, chunk_transfers=3)))
    assert sender == reference_cut(plan, 0) and _packed(sender).sends.runs  # rows as runs
    assert _shifted(sender) != reference_cut(plan, 0)


@pytest.mark.parametrize("relay", ["off", "on"])
@pytest.mark.parametrize("case", COMPILE_CASES)
def test_shared_blocks_equal_fresh_ones(case: tuple[str, str, str, str, str], relay: str) -> None:
    """A rows block cached by one rank and reused by others pickles as one built afresh for the
    rank alone (an empty cache), and each block is stored once per distinct row."""
    plan = _plan(case, 2048, 16384, relay)
    warm = _programs(plan)
    n = len(plan.ranks)
    batched = list(warm.rank_plans(range(n), plan.digest, chunk_transfers=50))
    kinds = {key[0] for key in warm._blocks._blocks}
    shared = 0
    for rank, program in enumerate(batched):
        cold = _programs(plan)  # nothing cached: every block built for this rank
        assert pickle.dumps(program) == pickle.dumps(cold.rank_plan(rank, plan.digest))
        for side in (_packed(program).sends, _packed(program).recvs):
            assert len(side.rows.transfers) <= int(side.buckets[:, 4].sum())  # never more rows than transfers
            assert len(side.index) == (len(side.buckets) if side.runs else int(side.buckets[:, 4].sum()))
            shared += any(side.rows is _packed(p).recvs.rows for p in batched[:rank])
    if relay == "off":
        assert "patterns" in kinds  # per sender: its patterns' rows
    if relay == "off" and not warm.table().mixed.any():  # mixed: rows depend on the sender
        assert "list" in kinds  # per destination position: its needs list's rows
        assert shared > 0  # replicas at one destination position share their block
    if warm.relayed.any():
        assert "buckets" in kinds  # relay copies: per distinct bucket


def test_a_receivers_block_travels_compressed_and_inflates_to_the_same_rows() -> None:
    plan = _plan(COMPILE_CASES[0], 2048, 16384, "off")
    rank = len(plan.ranks) - 1  # a destination receiving its whole needs list directly
    program = _programs(plan).rank_plan(rank, plan.digest)
    rows = _packed(program).recvs.rows
    assert rows.wire is not None
    plain = PackedRows(rows.transfers, rows.nbytes, rows.names)  # the same block, uncompressed
    blob = pickle.dumps(program)
    assert len(blob) < len(
        pickle.dumps(_with_recvs(program, dataclasses.replace(_packed(program).recvs, rows=plain)))
    )
    back = _packed(pickle.loads(blob)).recvs.rows
    assert back.names == plain.names
    assert back.transfers.dtype == np.int32 and np.array_equal(back.transfers, plain.transfers)
    assert back.nbytes.dtype == np.int64 and np.array_equal(back.nbytes, plain.nbytes)
    assert pickle.loads(blob) == reference_cut(plan, rank)
    # damaged: a header that does not match the body, a truncated body, a names count off by one
    n_rows, width, n_names, n_text = HEAD.unpack_from(rows.wire)
    body = rows.wire[HEAD.size :]
    for bad in (
        HEAD.pack(n_rows + 1, width, n_names, n_text) + body,
        rows.wire[:-5],
        HEAD.pack(n_rows, width, n_names + 1, n_text) + body,
    ):
        with pytest.raises(ValueError, match="compressed rows block"):
            pickle.loads(pickle.dumps(dataclasses.replace(rows, wire=bad)))


def test_programs_equal_with_a_cache_that_keeps_one_block() -> None:
    """Every insertion drops the blocks before it, also those a batch found cached a moment
    earlier (rebuilt alone): the programs are the same bytes."""
    plan = _plan(COMPILE_CASES[0], 2048, 16384, "off")
    n = len(plan.ranks)
    want = [pickle.dumps(p) for p in _programs(plan).rank_plans(range(n), plan.digest, chunk_transfers=50)]
    tight = _programs(plan)
    tight._blocks = BlockCache(1)
    ranks = [*range(n), *range(n)]  # twice: the second pass finds what the first cached
    got = [pickle.dumps(p) for p in tight.rank_plans(ranks, plan.digest, chunk_transfers=50)]
    assert got == want + want
    assert len(tight._blocks._blocks) == 1


def test_a_name_holding_the_separator_travels_as_a_tuple() -> None:
    rows = np.arange(6, dtype=np.int32).reshape(2, 3)
    names = ("a\0b", "c")
    block = PackedRows(rows, np.array([4, 5]), names)
    assert compressed(block) is block  # not joined, so not compressed either
    back = pickle.loads(pickle.dumps(block))
    assert back.names == names and np.array_equal(back.transfers, rows)
    plain = PackedRows(rows, np.array([4, 5]), ("ab", "c"))
    assert compressed(plain).wire is not None and pickle.loads(pickle.dumps(compressed(plain))).names == (
        "ab",
        "c",
    )


def test_a_block_dropped_while_a_batch_is_fetched_is_rebuilt_alone() -> None:
    def block(value: int) -> PackedRows:
        return PackedRows(np.full((1, 3), value, dtype=np.int32), np.array([value]), ())

    cache = BlockCache(1)  # keeps only the block made last
    cache.get(("b",), lambda: block(2))
    batches: list[list[int]] = []

    def build_many(picks: list[int]) -> list[PackedRows]:
        batches.append(picks)
        return [block(10 + p) for p in picks]

    got = cache.get_many([("c",), ("b",)], build_many)
    assert batches == [[0], [1]]  # c in the batch; b, cached when looked at, dropped by c
    assert [int(b.nbytes[0]) for b in got] == [10, 11]
    assert cache.get_many([("b",)], build_many)[0] is got[1]  # cached now: no build
    assert batches == [[0], [1]]


def test_names_renumbered_by_search_equal_those_by_table(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(COMPILE_CASES[2], 2048, 16384, "on")
    n = len(plan.ranks)
    by_table = [
        pickle.dumps(p) for p in _programs(plan).rank_plans(range(n), plan.digest, chunk_transfers=50)
    ]
    monkeypatch.setattr(tables, "RENUMBER_TABLE_LIMIT", 0)
    by_search = [
        pickle.dumps(p) for p in _programs(plan).rank_plans(range(n), plan.digest, chunk_transfers=50)
    ]
    assert by_search == by_table


@pytest.mark.parametrize("dense_limit", [1 << 30, 0])
def test_holder_index_lookups_agree_with_a_dict(dense_limit: int) -> None:
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 9, 30).tolist()
    sets = [tuple(sorted(rng.choice(50, size=n, replace=False).tolist())) for n in sizes]
    index = HolderIndex(sets, dense_limit=dense_limit)
    assert (index.dense is not None) == (dense_limit > 0)
    which = rng.integers(0, len(sets), 2000)
    ranks = rng.integers(0, 60, 2000)  # 50..59: no holder anywhere (a relay forwarder)
    where = [{r: h for h, r in enumerate(s)} for s in sets]
    want = [where[s].get(r, 0) for s, r in zip(which.tolist(), ranks.tolist(), strict=True)]
    assert index.lookup(which, ranks).tolist() == want
