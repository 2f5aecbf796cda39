"""Per-rank programs cut from the compact plan equal a straightforward cut of the full plan.

The reference scans every bucket of every round once per rank (the old `SyncPlan.for_rank`); the
compact plan answers from indices built once. A perturbed program must fail the comparison.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sync_runtime.core.models import load_model_config
from sync_runtime.core.plan import RankPlan, SyncPlan
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit

CASES = [
    ("tiny-llama", "tp=2,pp=2,dp=2", "tp=4,replicas=2"),
    ("tiny-llama-tied", "tp=2,pp=2,dp=2,layers=2+1", "tp=2,pp=2,replicas=3"),
    ("tiny-qwen3-moe", "tp=2,pp=2,dp=2,ep=4", "tp=2,ep=2,replicas=2"),
    ("tiny-deepseek-v3", "tp=2,pp=3,ep=2", "tp=4,ep=4"),
    ("tiny-qwen3-moe", "tp=2,pp=2,ep=2,etp=2,dp=2", "tp=4,replicas=3"),
]


def reference_cut(plan: SyncPlan, rank: int) -> RankPlan:
    """The obvious cut: every round's buckets filtered by rank."""
    sends = tuple(tuple(b for b in r.buckets if b.src_rank == rank) for r in plan.rounds)
    recvs = tuple(tuple(b for b in r.buckets if b.dst_rank == rank) for r in plan.rounds)
    return RankPlan(rank=rank, digest=plan.digest, sends=sends, recvs=recvs)


def _plan(model: str, src: str, dst: str, bucket: int, staging: int, relay: str) -> SyncPlan:
    manifest = build_manifest(load_model_config(model))
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    source = SideSpec("megatron", s, tuple(enumerate_ranks(s, Role.SOURCE, 4)))
    dest = SideSpec("vllm", d, tuple(enumerate_ranks(d, Role.DESTINATION, 4)))
    config = PlannerConfig(bucket_bytes=bucket, staging_budget_bytes=staging, relay=relay)  # type: ignore[arg-type]
    return plan_sync(manifest, source, [dest], config)


def _fresh(plan: SyncPlan) -> SyncPlan:
    """The same plan, not yet materialised: `for_rank` must not depend on `rounds` having been built."""
    return pickle.loads(pickle.dumps(plan))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(CASES),
    bucket=st.sampled_from([512, 2048, 1 << 20]),
    staging=st.sampled_from([4096, 16384, 1 << 22]),
    relay=st.sampled_from(["off", "on"]),
)
def test_programs_equal_the_reference_cut(
    case: tuple[str, str, str], bucket: int, staging: int, relay: str
) -> None:
    plan = _plan(*case, bucket, staging, relay)
    compact = _fresh(plan)
    for rank in range(len(plan.ranks)):
        assert compact.for_rank(rank) == reference_cut(plan, rank)
    # every bucket is in exactly one sender's and one receiver's program
    sent = sum(len(r) for rank in range(len(plan.ranks)) for r in compact.for_rank(rank).sends)
    assert sent == sum(len(r.buckets) for r in plan.rounds)


def _perturbations(program: RankPlan) -> list[RankPlan]:
    side = program.recvs if any(program.recvs) else program.sends
    index = next(i for i, r in enumerate(side) if r)
    bucket = side[index][0]
    t = bucket.transfers[0]
    (lo, hi), *rest = t.dst_box
    moved = dataclasses.replace(t, dst_box=((lo + 1, hi + 1), *rest))
    changed = dataclasses.replace(bucket, transfers=(moved, *bucket.transfers[1:]))
    swapped = tuple((changed, *r[1:]) if i == index else r for i, r in enumerate(side))
    after = (index + 1) % len(side)  # the bucket one round later (dropped if there is one round)
    late = tuple(r[1:] if i == index else (*r, bucket) if i == after else r for i, r in enumerate(side))

    def with_side(new: tuple) -> RankPlan:
        if side is program.recvs:
            return RankPlan(program.rank, program.digest, program.sends, new)
        return RankPlan(program.rank, program.digest, new, program.recvs)

    reversed_digest = RankPlan(program.rank, program.digest[::-1], program.sends, program.recvs)
    return [with_side(swapped), with_side(late), reversed_digest]


@pytest.mark.parametrize("case", CASES[:3])
def test_a_perturbed_program_fails_the_comparison(case: tuple[str, str, str]) -> None:
    plan = _plan(*case, 2048, 16384, "off")
    rank = len(plan.ranks) - 1  # a destination: it receives
    program = _fresh(plan).for_rank(rank)
    assert program == reference_cut(plan, rank)
    for bad in _perturbations(program):
        assert bad != reference_cut(plan, rank)


def test_a_rank_program_is_small() -> None:
    """A program pickles to at most twice its own transfers' description."""
    plan = _plan("tiny-qwen3-moe", "tp=2,pp=2,dp=2,ep=4", "tp=2,ep=2,replicas=2", 2048, 16384, "off")
    for rank in range(len(plan.ranks)):
        program = plan.for_rank(rank)
        ts = [t for side in (program.sends, program.recvs) for r in side for b in r for t in b.transfers]
        if ts:
            assert len(pickle.dumps(program)) <= 2 * len(pickle.dumps(ts))
