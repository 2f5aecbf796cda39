"""Delta syncs between real rank processes over gloo (transfer/delta_wire.py).

Two destination replicas (tp=1 each) take a source at tp=2 through several versions, each a few
percent of bf16 elements away from the last. A replica listed in `delta_base` rebuilds every
direct transfer from its live copy of the base; every committed tensor must equal, bit for
bit, what a full sync of that version leaves (the canonical weights materialized on the shard).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.topology import Role
from sync_runtime.errors import ChecksumMismatch
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import Scenario, canonical, mismatches, to_torch
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan
from sync_runtime.transfer.delta_wire import KeptBits

pytestmark = pytest.mark.e2e

SCENARIO = Scenario("tiny-llama", "tp=2", "tp=1,replicas=2", planner={"bucket_bytes": 64 * 1024})
DIRECT = 1024  # most bytes travel as direct transfers, the ones that go as deltas
CHANGED = 0.03


def stepped(manifest: Any, step: int) -> dict[str, np.ndarray]:
    """Canonical bf16 bits of version `step`: each step flips the low mantissa bit of ~3% of the
    elements of the previous one (and, at step 2, a sign bit and a NaN: changes like any other)."""
    canon = canonical(manifest, 11)
    for s in range(1, step + 1):
        for index, (_, bits) in enumerate(sorted(canon.items())):
            rng = np.random.default_rng([s, index])
            flat = bits.reshape(-1)
            flat[rng.random(flat.size) < CHANGED] ^= 1
            if s == 2 and flat.size > 8:
                flat[3] ^= 0x8000
                flat[5] = 0x7FC1
    return canon


def shard_tensors(shard: Any, manifest: Any, step: int) -> dict[str, torch.Tensor]:
    canon = stepped(manifest, step)
    names = {p.tensor for p in shard.pieces}
    return to_torch(materialize(shard, {n: a for n, a in canon.items() if n in names}), shard)


def connect(ctx: RankContext, suffix: str) -> SyncGroup:
    return SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=SCENARIO.world_size,
        backend="gloo", timeout_s=20.0, group_name=ctx.group_name + suffix,
    )  # fmt: skip


def delta_rank(ctx: RankContext, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run `steps` (version, step, delta_base, commit, corrupt) on this rank; one report each."""
    plan, manifest = SCENARIO.plan(), SCENARIO.manifest()
    role, shard = SCENARIO.shard(ctx.rank)
    dest = DestinationWeights(shard_tensors(shard, manifest, 99), version="v-stale")
    kept, group, reports = KeptBits(), connect(ctx, "-0"), []
    for n, st in enumerate(steps):
        sources = shard_tensors(shard, manifest, st["step"]) if role is Role.SOURCE else None
        if role is Role.DESTINATION:
            dest.begin(st["version"])
        config = TransferConfig(
            timeout_s=20.0, direct_min_bytes=DIRECT, delta_base=tuple(st["delta_base"].items())
        )
        is_dst = role is Role.DESTINATION
        result = run_rank_plan(
            group, plan.for_rank(ctx.rank), sources=sources, destination=dest if is_dst else None,
            config=config, kept=None if is_dst else kept,
        )  # fmt: skip
        report: dict[str, Any] = {
            "ok": result.ok,
            "reason": result.failure.reason if result.failure else None,
        }
        report.update(wire=result.wire_bytes, full=result.send_bytes, changed=result.delta_changed)
        report.update(elements=result.delta_elements)
        if role is Role.SOURCE and result.ok:
            kept.record(sources, st["version"])  # type: ignore[arg-type]
        if role is Role.DESTINATION:
            if result.ok and ctx.rank in st["commit"]:
                dest.commit(st["version"])
            else:
                dest.abort()
            report["version"] = dest.version
            want = shard_tensors(shard, manifest, st["step"])
            report["exact"] = (
                mismatches(dict(dest.tensors), want) == [] if dest.version == st["version"] else None
            )
            if ctx.rank == st.get("corrupt"):
                name = max(dest.tensors, key=lambda k: dest.tensors[k].numel())
                dest.tensors[name].view(torch.int16).reshape(-1)[7] ^= (
                    1  # live bytes altered after the commit
                )
        if not result.ok:  # a group that saw a failure is not reused
            group.close()
            group = connect(ctx, f"-{n + 1}")
        reports.append(report)
    group.close()
    return reports


@pytest.fixture
def world(rank_pool: LocalWorld) -> LocalWorld:
    """The session's shared rank pool (tests/conftest.py): these tests kill no rank."""
    return rank_pool


def _run(world: LocalWorld, steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    outcomes = world.run(delta_rank, [(steps,)] * SCENARIO.world_size, timeout_s=240)
    for o in outcomes:
        assert o.error is None and o.exitcode is None, o
    return [o.value for o in outcomes]


SOURCES, R0, R1 = (0, 1), (2,), (3,)  # tp=2 source; replica 0 is rank 2, replica 1 rank 3
ALL = {2, 3}


def test_deltas_over_several_steps_equal_full_syncs(world: LocalWorld) -> None:
    """Replica 0 takes every version after the first as deltas, replica 1 in full; both end bit
    for bit on each version, and the deltas' wire bytes are a fraction of the full ones."""
    steps = [{"version": "v0", "step": 0, "delta_base": {}, "commit": ALL}]
    for k in range(1, 4):
        steps.append({"version": f"v{k}", "step": k, "delta_base": {2: f"v{k - 1}"}, "commit": ALL})
    reports = _run(world, steps)
    for k, _ in enumerate(steps):
        for rank in (2, 3):
            assert reports[rank][k]["ok"] and reports[rank][k]["exact"], (k, rank, reports[rank][k])
    src = [reports[r] for r in SOURCES]
    assert all(s[0]["wire"] == s[0]["full"] for s in src)  # the first sync is full
    for k in range(1, 4):
        full = sum(s[k]["full"] for s in src)
        wire = sum(s[k]["wire"] for s in src)
        elements = sum(s[k]["elements"] for s in src)
        changed = sum(s[k]["changed"] for s in src) / elements
        assert 0.02 < changed < 0.045, changed  # ~3% of the elements moved per step
        # replica 1's half goes in full; replica 0's deltas cost ~3% x (value + position) of it
        assert wire < 0.5 * full + 0.15 * 0.5 * full, (k, wire, full)


def test_replica_on_an_older_version_gets_a_full_sync_in_the_same_run(world: LocalWorld) -> None:
    """Replica 1 does not commit v1; at v2 only replica 0 is listed as holding the base (v1), so
    replica 1 takes v2 whole in the same sync; both end on v2 bit for bit."""
    steps = [
        {"version": "v0", "step": 0, "delta_base": {}, "commit": ALL},
        {"version": "v1", "step": 1, "delta_base": {2: "v0", 3: "v0"}, "commit": {2}},
        {"version": "v2", "step": 2, "delta_base": {2: "v1"}, "commit": ALL},
    ]
    reports = _run(world, steps)
    assert reports[3][1]["version"] == "v0"
    for rank in (2, 3):
        assert reports[rank][2]["ok"] and reports[rank][2]["version"] == "v2" and reports[rank][2]["exact"]


def test_altered_live_base_is_caught_by_the_checksum_and_repaired_in_full(world: LocalWorld) -> None:
    """Rank 2's live bytes change after it committed v1 (one bit). The delta sync of v2 fails its
    checksum on that rank, nothing is committed (both replicas stay on v1), and the full sync
    that follows repairs it bit for bit. Negative control for the wrong base as well: the listed
    base is a fact only while the live bytes are the committed ones."""
    steps = [
        {"version": "v0", "step": 0, "delta_base": {}, "commit": ALL},
        {"version": "v1", "step": 1, "delta_base": {2: "v0", 3: "v0"}, "commit": ALL, "corrupt": 2},
        {"version": "v2", "step": 2, "delta_base": {2: "v1", 3: "v1"}, "commit": ALL},
        {"version": "v2", "step": 2, "delta_base": {3: "v1"}, "commit": ALL},
    ]
    reports = _run(world, steps)
    failed = [reports[r][2] for r in range(SCENARIO.world_size)]
    assert not any(r["ok"] for r in failed)
    assert failed[2]["reason"] == ChecksumMismatch.reason.value, failed  # the rank on the altered base
    assert reports[2][2]["version"] == "v1" and reports[3][2]["version"] == "v1"  # never committed
    for rank in (2, 3):
        assert reports[rank][3]["ok"] and reports[rank][3]["version"] == "v2" and reports[rank][3]["exact"]


def test_source_without_the_base_sends_dense_and_stays_exact(world: LocalWorld) -> None:
    """The listed base (v0) is not what the source kept (v1 was sent but not committed anywhere):
    the source sends dense messages in the delta format, and the replicas still end exact."""
    steps = [
        {"version": "v0", "step": 0, "delta_base": {}, "commit": ALL},
        {"version": "v1", "step": 1, "delta_base": {}, "commit": set()},
        {"version": "v2", "step": 2, "delta_base": {2: "v0", 3: "v0"}, "commit": ALL},
    ]
    reports = _run(world, steps)
    for rank in (2, 3):
        assert reports[rank][2]["ok"] and reports[rank][2]["exact"]
    assert all(reports[r][2]["elements"] == 0 for r in SOURCES)  # nothing compared: no base
    assert all(reports[r][2]["wire"] >= reports[r][2]["full"] for r in SOURCES)
