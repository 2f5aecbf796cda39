"""Staging policies (host / device / inplace), the source fence and the commit record.

Memory: `MemoryMeter` counts the bytes the staging layer allocates per tier. On this CPU-only
machine both tiers are the same RAM, so the CPU tests check where each policy puts its buffers
(device tier: next to the live tensors) and that the device tier stays within the planner's
staging budget for `host` and `inplace`; the CUDA test (skipped without a GPU) checks the same
bounds against torch.cuda's own allocator figures.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sync_runtime.core.topology import Role
from sync_runtime.errors import ChecksumMismatch, CommitFailed, SourceChanged, StagingError, SyncStep
from sync_runtime.runtime import participant_txn
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import Scenario, mismatches, rank_tensors
from sync_runtime.transfer import (
    CommitRecord,
    DestinationWeights,
    LocalTxn,
    Staging,
    SyncGroup,
    TransferConfig,
    run_rank_plan,
)
from sync_runtime.transfer.fence import check_fence, fingerprint, snapshot
from sync_runtime.transfer.txn import commit_decision, parse_decision

pytestmark = pytest.mark.e2e

BUDGET = {"bucket_bytes": 48 * 1024, "staging_budget_bytes": 256 * 1024}
RELAY = Scenario("tiny-llama", "tp=2", "tp=2,replicas=2", planner={**BUDGET, "relay": "on"})
PLAIN = Scenario("tiny-llama", "tp=2", "tp=2", planner=BUDGET)


def _weights() -> dict[str, torch.Tensor]:
    return {"a": torch.ones(64, 32), "b": torch.full((16,), 2.0)}


def _nbytes(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


@pytest.mark.parametrize("policy", ["host", "device", "inplace"])
def test_policy_semantics_and_meter(policy: str) -> None:
    live = _weights()
    dw = DestinationWeights(live, version="v0", policy=policy)  # type: ignore[arg-type]
    refs = {n: t.data_ptr() for n, t in live.items()}
    dw.begin("v1")
    for name in live:
        dw.staged(name, fully_written=True).fill_(7.0)
    if policy == "inplace":
        assert dw.poisoned and torch.all(live["a"] == 7.0)  # applied as it arrives
    else:
        assert not dw.poisoned and torch.all(live["a"] == 1.0)  # live untouched until commit
    extra = _nbytes(live) if policy != "inplace" else 0
    assert dw.meter.peak == {
        "device": extra if policy == "device" else 0,
        "host": extra if policy == "host" else 0,
    }
    with pytest.raises(StagingError):
        dw.commit("v2")  # ws_commit's version must be the staged one
    assert dw.commit("v1") == "v1" and dw.version == "v1" and not dw.poisoned
    assert all(torch.all(t == 7.0) for t in dw.tensors.values())
    assert {n: t.data_ptr() for n, t in dw.tensors.items()} == refs  # the engine's references hold
    assert dw.meter.current == {"device": 0, "host": 0}  # staging freed after the commit


def test_inplace_abort_poisons_and_next_sync_clears() -> None:
    dw = DestinationWeights(_weights(), version="v0", policy="inplace")
    dw.begin("v1")
    dw.staged("a", fully_written=True).fill_(3.0)
    dw.abort()
    assert dw.poisoned and dw.version == "v0"
    dw.begin("v2")
    for name in dw.tensors:
        dw.staged(name, fully_written=True).fill_(5.0)
    assert dw.commit() == "v2" and not dw.poisoned


def test_host_and_device_abort_keep_live() -> None:
    for policy in ("host", "device"):
        dw = DestinationWeights(_weights(), version="v0", policy=policy)  # type: ignore[arg-type]
        before = dw.checksums()
        dw.begin("v1")
        dw.staged("a").fill_(9.0)
        dw.abort()
        assert dw.checksums() == before and dw.version == "v0" and not dw.poisoned


def test_bad_policy_refused() -> None:
    with pytest.raises(StagingError, match="must be one of host, device, inplace"):
        DestinationWeights(_weights(), policy="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging='gpu'"):
        TransferConfig(staging="gpu")
    dw = DestinationWeights(_weights())
    dw.begin("v1")
    with pytest.raises(StagingError, match="middle of a sync"):
        dw.set_policy("device")


def policy_rank(ctx: RankContext, scenario: Scenario, policy: str) -> dict:
    plan = scenario.plan()
    role, shard = scenario.shard(ctx.rank)
    manifest = scenario.manifest()
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=scenario.world_size,
        backend="gloo", timeout_s=20.0, group_name=ctx.group_name,
    )  # fmt: skip
    dest = None
    if role is Role.DESTINATION:
        dest = DestinationWeights(rank_tensors(shard, manifest, seed=999), version="v0", policy=policy)  # type: ignore[arg-type]
        dest.begin("v1")
    sources = rank_tensors(shard, manifest, 1) if role is Role.SOURCE else None
    result = run_rank_plan(group, plan.for_rank(ctx.rank), sources=sources, destination=dest,
                           config=TransferConfig(timeout_s=20.0, staging=policy))  # fmt: skip
    report: dict = {"ok": result.ok, "failure": result.failure, "role": role.value}
    if dest is not None and result.ok:
        report["peak"] = dict(dest.meter.peak)
        report["weights"] = _nbytes(dict(dest.tensors))
        dest.commit("v1")
        report["mismatches"] = mismatches(dict(dest.tensors), rank_tensors(shard, manifest, 1))
    group.close()
    return report


@pytest.fixture
def world(rank_pool: LocalWorld) -> LocalWorld:
    """The session's shared rank pool (tests/conftest.py): these tests kill no rank."""
    return rank_pool


@pytest.mark.parametrize("scenario", [PLAIN, RELAY], ids=["plain", "relay"])
@pytest.mark.parametrize("policy", ["host", "device", "inplace"])
def test_real_sync_per_policy_is_exact_and_bounded(
    world: LocalWorld, scenario: Scenario, policy: str
) -> None:
    outcomes = world.run(policy_rank, [(scenario, policy)] * scenario.world_size, timeout_s=120)
    budget = BUDGET["staging_budget_bytes"]
    dests = [o.value for o in outcomes if o.value and o.value["role"] == "destination"]
    assert all(o.error is None and o.value["ok"] for o in outcomes), outcomes
    for rep in dests:
        assert rep["mismatches"] == []
        device = rep["peak"]["device"]
        if policy == "device":
            assert device == rep["weights"]  # the shadow copy: 2x the weights with the live ones
        else:
            assert device <= budget, (policy, device, budget)  # 0 from staging itself
        if policy == "host":
            assert rep["peak"]["host"] == rep["weights"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: physical device memory")
@pytest.mark.parametrize("policy", ["host", "device", "inplace"])
def test_cuda_extra_device_memory_per_policy(policy: str) -> None:
    live = {f"w{i}": torch.randn(4096, 4096, device="cuda") for i in range(4)}  # 256 MiB
    weights = _nbytes(live)
    dw = DestinationWeights(live, policy=policy)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dw.begin("v1")
    for name, t in live.items():
        dw.staged(name, fully_written=True).copy_(t + 1)  # `t + 1`: one tensor-sized temporary
    dw.commit("v1")
    extra = torch.cuda.max_memory_allocated() - base - 16 * 2**20  # minus the temporary
    print(f"{policy}: extra device bytes {extra / 2**20:.1f} MiB for {weights / 2**20:.0f} MiB weights")
    if policy == "device":
        assert 0.95 * weights <= extra <= 1.05 * weights
    else:
        assert extra <= 1 << 20
    assert dw.meter.peak["device"] == (weights if policy == "device" else 0)


def test_fence_sees_a_training_step_and_a_raw_write() -> None:
    src = {"w": torch.zeros(1000, 100), "b": torch.zeros(10)}
    before = fingerprint(src)
    check_fence(before, src, rank=0)  # unchanged: passes
    src["w"].add_(1.0)  # an optimizer step: bumps the version counter
    with pytest.raises(SourceChanged) as e:
        check_fence(before, src, rank=3)
    assert e.value.tensor == "w" and e.value.rank == 3
    before = fingerprint(src)
    src["b"].numpy()[0] = 5.0  # bypasses the counter; a sampled byte changed
    with pytest.raises(SourceChanged):
        check_fence(before, src, rank=0)


def test_snapshot_is_a_host_copy_the_trainer_may_step_past() -> None:
    src = {"w": torch.arange(12.0).view(3, 4)}
    snap = snapshot(src, rank=0)
    src["w"].add_(1.0)
    assert torch.equal(snap["w"], torch.arange(12.0).view(3, 4))
    assert snap["w"].data_ptr() != src["w"].data_ptr()


def test_commit_record_decides_once() -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    rec = CommitRecord(store, "txn-1")
    rec.prepare(2, "v1", "abc")
    assert rec.prepared([2, 3])[2].checksum == "abc" and 3 not in rec.prepared([2, 3])
    assert rec.decide(commit_decision("v1")) == "commit:v1"
    assert rec.decide("abort") == "commit:v1"  # a second coordinator cannot overturn it
    assert parse_decision(CommitRecord(store, "txn-1").decision()) == ("commit", "v1")
    rec.mark_committed(2, "v1")
    assert rec.committed([2, 3]) == {2: "v1"}
    with pytest.raises(ValueError):
        rec.decide("maybe")
    with pytest.raises(ValueError):
        CommitRecord(store, "a/b")


def test_destination_weights_is_a_staging() -> None:
    assert isinstance(DestinationWeights(_weights()), Staging)


def test_rank_commit_checks_version_decision_and_bytes() -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )

    def prepared(txn: str) -> tuple[DestinationWeights, CommitRecord, LocalTxn]:
        dw, rec, local = (
            DestinationWeights(_weights(), version="v0"),
            CommitRecord(store, txn),
            LocalTxn(txn, "v1"),
        )
        dw.begin("v1")
        for name in dw.tensors:
            dw.staged(name, fully_written=True).fill_(4.0)
        participant_txn.prepare(dw, rec, local, rank=2)
        return dw, rec, local

    dw, rec, local = prepared("t1")
    assert rec.prepared([2])[2].version == "v1" and local.phase == "prepared"
    with pytest.raises(CommitFailed, match="holds prepared 'v1'"):
        participant_txn.commit(dw, rec, local, 2, "v9")  # ws_commit honours its version
    with pytest.raises(CommitFailed, match="the record decided"):
        rec.decide("abort")
        participant_txn.commit(dw, rec, local, 2, "v1")
    assert dw.version == "v0"
    dw, rec, local = prepared("t2")
    rec.decide(commit_decision("v1"))
    dw.staged("a").view(-1)[0] = -1.0  # corrupted after the decision
    with pytest.raises(ChecksumMismatch) as e:
        participant_txn.commit(dw, rec, local, 2, "v1")
    assert e.value.step is SyncStep.COMMIT and dw.version == "v0" and not dw.staging_active
    dw, rec, local = prepared("t3")
    rec.decide(commit_decision("v1"))
    assert participant_txn.commit(dw, rec, local, 2, "v1") == "v1"
    assert rec.committed([2]) == {2: "v1"} and local.phase == "committed"
