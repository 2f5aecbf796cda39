"""The MTP part synced between real processes (gloo): a tiny DeepSeek-V3 with one MTP layer, an hf
source (tp=2), a vLLM destination that serves MTP (tp=2) and one that does not (tp=1).

The serving destination's committed drafter tensors equal `materialize(shard, canon)` bit for
bit; the other holds no MTP tensor and is sent none. Negative control: a source whose MTP
eh_proj is scrambled leaves the serving destination's drafter eh_proj wrong, and nothing else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.manifest import MTP_PART, Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import mismatches, rank_tensors
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan

pytestmark = pytest.mark.e2e

SMALL = PlannerConfig(bucket_bytes=48 * 1024, staging_budget_bytes=256 * 1024)
SCRAMBLED = "model.layers.3.eh_proj.weight"
"""The source's local name (hf layout: canonical) of the MTP tensor the negative control scrambles."""
DRAFTER_EH_PROJ = "drafter.model.layers.3.eh_proj.weight"


def _sides() -> tuple[SideSpec, list[SideSpec]]:
    def side(text: str, role: Role, mtp: bool = False, node: str = "") -> SideSpec:
        spec = ParallelSpec.parse(text)
        coords = [dataclasses.replace(c, node=c.node + node) for c in enumerate_ranks(spec, role)]
        return SideSpec("vllm" if role is Role.DESTINATION else "hf", spec, tuple(coords), mtp)

    source = side("tp=2", Role.SOURCE)
    return source, [side("tp=2", Role.DESTINATION, True, "-a"), side("tp=1", Role.DESTINATION, False, "-b")]


def _where(rank: int) -> tuple[SideSpec, int]:
    """The side of global rank `rank` (source first, then each destination) and the index within it."""
    source, destinations = _sides()
    for side in (source, *destinations):
        if rank < len(side.coords):
            return side, rank
        rank -= len(side.coords)
    raise IndexError(rank)


def _held(manifest: Manifest, side: SideSpec) -> Manifest:
    # The sources hold the MTP part (a destination serves it); destinations hold what they serve.
    return manifest.with_mtp() if side.mtp or side.coords[0].role is Role.SOURCE else manifest


def mtp_rank(ctx: RankContext, world_size: int, seed: int, scramble: bool) -> dict:
    manifest = build_manifest(load_model_config("tiny-deepseek-v3"))
    source, destinations = _sides()
    plan = plan_sync(manifest, source, destinations, SMALL)
    side, index = _where(ctx.rank)
    held = _held(manifest, side)
    shard = get_layout(side.layout).shard(held, side.spec, side.coords[index])
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=world_size,
        backend="gloo", timeout_s=20.0, group_name=ctx.group_name,
    )  # fmt: skip
    sources = dest = None
    if side.coords[0].role is Role.SOURCE:
        sources = rank_tensors(shard, held, seed)
        if scramble:
            sources[SCRAMBLED] = sources[SCRAMBLED] + 1.0  # every bf16 value of it changes
    else:
        dest = DestinationWeights(rank_tensors(shard, held, seed=999), version="v0")
        dest.begin(f"v{seed}")
    result = run_rank_plan(group, plan.for_rank(ctx.rank), sources=sources, destination=dest,
                           config=TransferConfig(timeout_s=20.0))  # fmt: skip
    group.close()
    report = {"ok": result.ok, "failure": result.failure, "role": side.coords[0].role.value}
    if dest is not None and result.ok:
        report["version"] = dest.commit()
        report["mismatches"] = mismatches(dict(dest.tensors), rank_tensors(shard, held, seed))
        report["names"] = sorted(dest.tensors)
        report["canonical"] = sorted({p.tensor for p in shard.pieces})
        report["side"] = "mtp" if side.mtp else "plain"
    return report


@pytest.fixture
def world(rank_pool: LocalWorld) -> LocalWorld:
    """The session's shared rank pool (tests/conftest.py): these tests kill no rank."""
    return rank_pool


def _run(world: LocalWorld, scramble: bool) -> list[dict]:
    source, destinations = _sides()
    n = len(source.coords) + sum(len(d.coords) for d in destinations)
    outcomes = world.run(mtp_rank, [(n, 21, scramble)] * n, timeout_s=90)  # pool ranks 0..n-1
    for o in outcomes:
        assert o.error is None and o.exitcode is None, o
        assert o.value["ok"], o.value
    return [o.value for o in outcomes]


def test_mtp_sent_bit_exact_where_served_and_absent_where_not(world: LocalWorld) -> None:
    manifest = build_manifest(load_model_config("tiny-deepseek-v3"))
    mtp_names = {t.name for t in manifest.mtp}
    source, destinations = _sides()
    stats = plan_sync(manifest, source, destinations, SMALL).stats
    assert stats["side_mtp_bytes"][0] > 0 and stats["side_mtp_bytes"][1] == 0
    reports = [r for r in _run(world, scramble=False) if r["role"] == "destination"]
    served = [r for r in reports if r["side"] == "mtp"]
    plain = [r for r in reports if r["side"] == "plain"]
    assert len(served) == 2 and len(plain) == 1
    for r in reports:
        assert r["mismatches"] == [] and r["version"] == "v21", r
    # vLLM's drafter uses the target's embedding and lm_head: the MTP layer's own are not held.
    shared = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    for r in served:  # every other MTP tensor reached each TP rank of the serving destination
        assert set(r["canonical"]) & mtp_names == mtp_names - shared
        assert DRAFTER_EH_PROJ in r["names"] and "drafter.model.layers.3.enorm.weight" in r["names"]
    for r in plain:  # nothing of the MTP part is held, hence none was sent
        assert not mtp_names & set(r["canonical"])
        assert not any(n.startswith("drafter.") for n in r["names"])
    assert manifest.part_nbytes(MTP_PART) > 0


def test_scrambled_mtp_tensor_is_caught(world: LocalWorld) -> None:
    # Negative control: the same sync with the source's MTP eh_proj scrambled. The serving ranks'
    # drafter eh_proj (a whole copy on each) differs from the canonical one; nothing else does.
    reports = [r for r in _run(world, scramble=True) if r["role"] == "destination"]
    for r in reports:
        assert r["mismatches"] == ([DRAFTER_EH_PROJ] if r["side"] == "mtp" else []), r
    assert torch.tensor(1.0, dtype=torch.bfloat16) + 1.0 != 1.0  # the scramble changes bf16 values
