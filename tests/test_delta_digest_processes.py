"""Ranks that disagree on a sync's encoding refuse it before the first byte (real processes, gloo).

Four rank processes (a tp=2 source, two tp=1 replicas) run the same plan. When every rank is
told the same encoding the sync succeeds (control); when one rank is told that replica 0 takes
deltas from v0 and the others that it takes the sync in full, the digest they agree on differs
(planner.digest.sync_digest covers the encoding) and every rank fails with PlanMismatch while
no destination commits anything.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.topology import Role
from sync_runtime.errors import PlanMismatchError
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import Scenario, canonical, to_torch
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan

pytestmark = pytest.mark.e2e

SCENARIO = Scenario("tiny-llama", "tp=2", "tp=1,replicas=2", planner={"bucket_bytes": 64 * 1024})


def encoded_rank(ctx: RankContext, bases: dict[int, dict[int, str]], suffix: str) -> dict[str, Any]:
    """One sync of v1 on this rank, told the encoding `bases[rank]` (destination rank -> base)."""
    plan, manifest = SCENARIO.plan(), SCENARIO.manifest()
    role, shard = SCENARIO.shard(ctx.rank)
    names = {p.tensor for p in shard.pieces}
    mine = to_torch(
        materialize(shard, {n: a for n, a in canonical(manifest, 3).items() if n in names}), shard
    )
    dest = None
    if role is Role.DESTINATION:
        dest = DestinationWeights({n: torch.zeros_like(t) for n, t in mine.items()}, version="v0")
        dest.begin("v1")
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=SCENARIO.world_size,
        backend="gloo", timeout_s=20.0, group_name=ctx.group_name + suffix,
    )  # fmt: skip
    config = TransferConfig(timeout_s=20.0, direct_min_bytes=1024, delta_base=tuple(bases[ctx.rank].items()))
    sources = mine if role is Role.SOURCE else None
    result = run_rank_plan(group, plan.for_rank(ctx.rank), sources=sources, destination=dest, config=config)
    if dest is not None:
        dest.commit("v1") if result.ok else dest.abort()
    group.close()
    return {
        "ok": result.ok,
        "reason": result.failure.reason if result.failure else None,
        "version": dest.version if dest is not None else None,
    }


def _run(world: LocalWorld, bases: dict[int, dict[int, str]], suffix: str) -> list[dict[str, Any]]:
    outcomes = world.run(encoded_rank, [(bases, suffix)] * SCENARIO.world_size, timeout_s=120)
    for o in outcomes:
        assert o.error is None and o.exitcode is None, o
    return [o.value for o in outcomes]


def test_ranks_told_different_encodings_refuse_the_sync(rank_pool: LocalWorld) -> None:
    ranks = range(SCENARIO.world_size)
    agreed = _run(rank_pool, {r: {} for r in ranks}, "-agree")
    assert all(r["ok"] for r in agreed), agreed  # control: the same encoding everywhere syncs
    assert [r["version"] for r in agreed[2:]] == ["v1", "v1"]
    told = {r: ({2: "v0"} if r == 0 else {}) for r in ranks}  # source rank 0 alone: replica 0 as deltas
    refused = _run(rank_pool, told, "-disagree")
    assert not any(r["ok"] for r in refused), refused
    assert any(r["reason"] == PlanMismatchError.reason.value for r in refused), refused
    assert [r["version"] for r in refused[2:]] == ["v0", "v0"]  # nothing committed
