"""Context parallelism on the source: CP ranks hold identical shards and are alternative senders."""

from __future__ import annotations

import json

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.core.layouts import get_layout
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.errors import TopologyError
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.planner.simulate import check_plan
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit


def test_cp_parses_describes_and_counts() -> None:
    spec = ParallelSpec.parse("tp=2,cp=2,dp=2,pp=2")
    assert spec.cp == 2 and spec.world_size == 16
    assert ParallelSpec.parse(spec.describe()) == spec
    assert "cp=2" in spec.describe() and "cp" not in ParallelSpec(tp=2).describe()
    assert ParallelSpec.parse("tp=2,cp=2,ep=4").edp == 1  # experts regrouped over tp*cp*dp
    with pytest.raises(TopologyError, match="cp=0"):
        ParallelSpec(cp=0)


def test_destinations_have_no_cp() -> None:
    with pytest.raises(TopologyError, match="source-side"):
        enumerate_ranks(ParallelSpec(tp=2, cp=2), Role.DESTINATION)


@pytest.mark.parametrize("text", ["tp=2,cp=2,dp=2,ep=4,pp=2", "tp=2,cp=2,ep=2,etp=2", "tp=1,cp=4,dp=2,ep=8"])
def test_ranks_follow_megatron_rank_generators(text: str) -> None:
    """Global order tp, cp, dp, pp and the expert coordinates equal Megatron-Core's own groups."""
    from megatron.core.parallel_state import RankGenerator

    s = ParallelSpec.parse(text)
    coords = enumerate_ranks(s, Role.SOURCE)
    dense = RankGenerator(tp=s.tp, ep=1, dp=s.dp, pp=s.pp, cp=s.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=s.etp, ep=s.ep, dp=s.edp, pp=s.pp, cp=1, order="tp-ep-dp-pp")

    def position(generator: RankGenerator, token: str) -> dict[int, int]:
        return {rank: i for group in generator.get_ranks(token) for i, rank in enumerate(group)}

    for attr, generator, token in [
        ("tp_rank", dense, "tp"),
        ("cp_rank", dense, "cp"),
        ("dp_rank", dense, "dp"),
        ("pp_rank", dense, "pp"),
        ("ep_rank", expert, "ep"),
        ("etp_rank", expert, "tp"),
        ("edp_rank", expert, "dp"),
    ]:
        want = position(generator, token)
        assert [getattr(c, attr) for c in coords] == [want[g] for g in range(len(coords))], attr


def _dense(pieces: tuple) -> list:
    return [p for p in pieces if ".experts." not in p.tensor]


def _plan(model: str, layout: str, src: str, dst: str) -> tuple:
    manifest = build_manifest(load_model_config(model))
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    source = SideSpec(layout, s, tuple(enumerate_ranks(s, Role.SOURCE, gpus_per_node=4)))
    destination = SideSpec("vllm", d, tuple(enumerate_ranks(d, Role.DESTINATION, gpus_per_node=4)))
    plan = plan_sync(manifest, source, [destination], PlannerConfig(bucket_bytes=1 << 14))
    shards = {
        r: get_layout(side.layout).shard(manifest, side.spec, c)
        for r, (side, c) in enumerate(
            [(source, c) for c in source.coords] + [(destination, c) for c in destination.coords]
        )
    }
    return manifest, source, plan, shards


@pytest.mark.parametrize(
    ("model", "layout", "src", "dst"),
    [
        ("tiny-llama", "megatron", "tp=2,cp=2", "tp=2,replicas=2"),
        ("tiny-qwen3-moe", "megatron", "tp=2,cp=2,ep=2", "tp=2,ep=2,replicas=2"),
        ("tiny-deepseek-v3", "megatron", "tp=2,cp=2,dp=2,ep=4", "tp=2,replicas=2"),
        ("tiny-gpt-oss", "hf", "tp=2,cp=2", "tp=2,replicas=2"),
    ],
)
def test_cp_plans_are_exact_minimal_and_use_every_cp_rank(
    model: str, layout: str, src: str, dst: str
) -> None:
    manifest, source, plan, shards = _plan(model, layout, src, dst)
    assert check_plan(plan, manifest, shards) == []
    assert plan.stats["wire_bytes"] == plan.stats["lower_bound_bytes"]
    # Every CP rank of a (pp, dp, tp) position holds the same dense shard (routed experts are
    # regrouped over tp*cp*dp: with EP across CP ranks, they hold different experts) ...
    n = len(source.coords)
    first = {(c.pp_rank, c.dp_rank, c.tp_rank): r for r, c in enumerate(source.coords) if c.cp_rank == 0}
    for r, c in enumerate(source.coords):
        twin = first[(c.pp_rank, c.dp_rank, c.tp_rank)]
        assert _dense(shards[r].pieces) == _dense(shards[twin].pieces)
        assert c.cp_rank == 0 or r != twin
    # ... and each sends: CP doubles the alternative senders, nothing more is moved.
    sent = [0] * n
    for rnd in plan.rounds:
        for b in rnd.buckets:
            sent[b.src_rank] += b.nbytes
    assert all(s > 0 for s in sent), sent
    base = ParallelSpec.parse(src)
    no_cp = _plan(model, layout, base.describe().replace(f"cp={base.cp}", "cp=1").replace(",cp=1", ""), dst)[
        2
    ]
    assert plan.stats["wire_bytes"] == no_cp.stats["wire_bytes"]
    assert max(sent) < max(
        sum(b.nbytes for rnd in no_cp.rounds for b in rnd.buckets if b.src_rank == r)
        for r in range(n // base.cp)
    )


def test_cli_plans_a_cp_source(capsys) -> None:
    code = cli.main(
        ["plan", "--model", "tiny-qwen3-moe", "--src", "tp=2,cp=2,ep=2", "--dst", "tp=2", "--json"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["wire_bytes"] == summary["lower_bound_bytes"]
    assert cli.main(["plan", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=2,cp=2"]) == 2
    assert "cp" in capsys.readouterr().err
