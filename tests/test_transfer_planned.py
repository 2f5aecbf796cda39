"""The transfer engine executing real planner output between real processes over gloo.

Every destination rank's committed tensors must equal `materialize(dst_shard, canon)` bit for
bit. Small buckets and a small staging budget force many buckets and rounds, so the
double-buffered path (pack ahead, unpack behind) is what runs.
"""

from __future__ import annotations

import pytest

from sync_runtime.core.topology import Role
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import Scenario, mismatches, rank_tensors
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan

pytestmark = pytest.mark.e2e

POOL = 6
SMALL = {"bucket_bytes": 48 * 1024, "staging_budget_bytes": 256 * 1024}
# nh=12, nkv=6: both a 3-way Megatron split and a 2-way vLLM split are legal (TP 3 -> 2).
LLAMA_12_HEADS = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96,
    "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 12,
    "num_key_value_heads": 6, "head_dim": 8, "vocab_size": 500, "tie_word_embeddings": False,
}  # fmt: skip

SCENARIOS = {
    "equal-tp2": Scenario("tiny-llama", "tp=2", "tp=2", planner=SMALL),
    "tp-up-2to4": Scenario("tiny-llama", "tp=2", "tp=4", planner=SMALL),
    "tp-down-2to1-replicas2": Scenario("tiny-qwen3", "tp=2", "tp=1,replicas=2", planner=SMALL),
    "tp-3to2": Scenario(LLAMA_12_HEADS, "tp=3", "tp=2", planner=SMALL),
    "pp-both-sides": Scenario("tiny-llama", "tp=1,pp=2", "tp=2,pp=2", planner=SMALL),
    "vpp-to-tp2": Scenario("tiny-llama", "tp=1,pp=2,vpp=2", "tp=2", planner=SMALL),
    "moe-ep-both": Scenario("tiny-qwen3-moe", "tp=2,ep=2", "tp=2,ep=2", planner=SMALL),
    "relay-replicas2": Scenario("tiny-llama", "tp=2", "tp=2,replicas=2", planner={**SMALL, "relay": "on"}),
}


def planned_rank(ctx: RankContext, scenario: Scenario, seeds: list[int], direct: int) -> list[dict]:
    plan = scenario.plan()
    role, shard = scenario.shard(ctx.rank)
    manifest = scenario.manifest()
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=scenario.world_size,
        backend="gloo", timeout_s=20.0, group_name=ctx.group_name,
    )  # fmt: skip
    dest = None
    if role is Role.DESTINATION:
        stale = rank_tensors(shard, manifest, seed=999)  # a previous version, to be overwritten
        dest = DestinationWeights(stale, version="v0")
    reports = []
    for seed in seeds:
        sources = rank_tensors(shard, manifest, seed) if role is Role.SOURCE else None
        if dest is not None:
            dest.begin(f"v{seed}")
        result = run_rank_plan(group, plan.for_rank(ctx.rank), sources=sources, destination=dest,
                               config=TransferConfig(timeout_s=20.0, direct_min_bytes=direct))  # fmt: skip
        report = {"ok": result.ok, "failure": result.failure, "rounds": len(plan.rounds), "relay": plan.relay}
        if dest is not None and result.ok:
            report["version"] = dest.commit()
            report["mismatches"] = mismatches(dict(dest.tensors), rank_tensors(shard, manifest, seed))
        reports.append(report)
    group.close()
    return reports


@pytest.fixture
def world(rank_pool: LocalWorld) -> LocalWorld:
    """The session's shared rank pool (tests/conftest.py): these tests kill no rank."""
    return rank_pool


@pytest.mark.parametrize("direct", [TransferConfig().direct_min_bytes, 1024], ids=["default", "direct1k"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_planned_sync_is_bit_exact(world: LocalWorld, name: str, direct: int) -> None:
    # Tiny models: with the default threshold every transfer is packed; 1 KiB sends most bytes
    # as their own messages, in place where the regions are contiguous, bounced where strided.
    scenario = SCENARIOS[name]
    assert scenario.world_size <= POOL
    seeds = [11, 12] if name == "equal-tp2" else [11]  # equal-tp2 also covers the warm path
    outcomes = world.run(planned_rank, [(scenario, seeds, direct)] * scenario.world_size, timeout_s=90)
    for o in outcomes:
        assert o.error is None and o.exitcode is None, o
        assert [r["ok"] for r in o.value] == [True] * len(seeds), o.value
        for seed, report in zip(seeds, o.value, strict=True):
            if "mismatches" in report:
                assert report["mismatches"] == [], (o.rank, report)
                assert report["version"] == f"v{seed}"
    destinations = [o for o in outcomes if "mismatches" in o.value[0]]
    assert len(destinations) == len(scenario.sides()[1].coords)
    assert outcomes[0].value[0]["rounds"] > 1  # small budgets: several rounds, double buffering in use
    if name.startswith("relay"):
        assert outcomes[0].value[0]["relay"] is True
