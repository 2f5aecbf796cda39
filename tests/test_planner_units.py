"""Table tests of the planner's parts: box geometry, sender choice, bucket packing, round limits."""

from __future__ import annotations

import dataclasses

import pytest

from sync_runtime.core.layouts.base import Box, Layout, Piece, RankShard
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.plan import Transfer
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import LayoutError, PlanError, TopologyError
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.planner.needs import Need
from sync_runtime.planner.refine import SourceCell, build_cells, intersect, split_rows, to_local
from sync_runtime.planner.schedule import direct_queue, pack_buckets, schedule_rounds
from sync_runtime.planner.senders import SenderChooser
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit

# ---- geometry ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (((0, 4), (0, 8)), ((2, 6), (0, 8)), ((2, 4), (0, 8))),
        (((0, 4), (0, 8)), ((4, 6), (0, 8)), None),
        (((0, 4), (0, 8)), ((1, 3), (2, 5)), ((1, 3), (2, 5))),
        (((0, 4),), ((3, 9),), ((3, 4),)),
    ],
)
def test_intersect(a: Box, b: Box, expected: Box | None) -> None:
    assert intersect(a, b) == expected


@pytest.mark.parametrize(
    ("sub", "canon", "local", "expected"),
    [
        (((2, 4), (0, 8)), ((0, 4), (0, 8)), ((10, 14), (0, 8)), ((12, 14), (0, 8))),
        # a stacked expert: one extra leading dim of extent 1 on the local side
        (((1, 2), (3, 5)), ((0, 2), (0, 8)), ((3, 4), (4, 6), (0, 8)), ((3, 4), (5, 6), (3, 5))),
        (((0, 4),), ((0, 4),), ((8, 12),), ((8, 12),)),
    ],
)
def test_to_local(sub: Box, canon: Box, local: Box, expected: Box) -> None:
    assert to_local(sub, canon, local) == expected


@pytest.mark.parametrize(
    ("box", "itemsize", "max_bytes", "expected"),
    [
        (((0, 4), (0, 8)), 2, 64, [((0, 4), (0, 8))]),
        (((0, 4), (0, 8)), 2, 32, [((0, 2), (0, 8)), ((2, 4), (0, 8))]),
        (((0, 5), (0, 8)), 2, 48, [((0, 3), (0, 8)), ((3, 5), (0, 8))]),
        # a single row is too large: split each row along the next dim
        (((0, 2), (0, 8)), 2, 8, [((0, 1), (0, 4)), ((0, 1), (4, 8)), ((1, 2), (0, 4)), ((1, 2), (4, 8))]),
        # leading extent-1 dims are skipped
        (((3, 4), (0, 4), (0, 2)), 4, 16, [((3, 4), (0, 2), (0, 2)), ((3, 4), (2, 4), (0, 2))]),
    ],
)
def test_split_rows(box: Box, itemsize: int, max_bytes: int, expected: list[Box]) -> None:
    assert split_rows(box, itemsize, max_bytes) == expected


def test_identical_source_boxes_become_one_cell_with_alternative_holders() -> None:
    box = ((0, 4), (0, 8))
    cells = build_cells([(r, Piece("w", box, f"local{r}", box)) for r in (0, 3, 5)])
    assert [c.box for c in cells["w"]] == [box]
    assert cells["w"][0].ranks == (0, 3, 5)


def test_overlapping_source_boxes_are_refined_into_disjoint_cells() -> None:
    a, b = ((0, 6), (0, 4)), ((4, 8), (0, 4))
    cells = build_cells([(0, Piece("w", a, "x", a)), (1, Piece("w", b, "y", b))])["w"]
    assert [(c.box, c.ranks) for c in cells] == [
        (((0, 4), (0, 4)), (0,)),
        (((4, 6), (0, 4)), (0, 1)),
        (((6, 8), (0, 4)), (1,)),
    ]


# ---- sender choice -----------------------------------------------------------------------------


def _need(ranks: tuple[int, ...], nbytes: int, tensor: str = "w") -> Need:
    box = ((0, nbytes),)
    cell = SourceCell(box, [(r, Piece(tensor, box, "w", box)) for r in ranks], ranks)
    return Need(tensor, cell, box, "w", box, nbytes, [None] * len(ranks))


@pytest.mark.parametrize(
    ("holders", "items", "receivers", "expected_loads"),
    [
        # four DP copies, four receivers each needing one 100-byte item: one each
        ((0, 1, 2, 3), [100], [10, 11, 12, 13], [100, 100, 100, 100]),
        # two copies, sizes 5,4,3,3,3 (LPT): 5+3+1? -> 5,3 | 4,3,3? greedy: 5|4, 3->B(7), 3->A(8), 3->B(10)
        ((0, 1), [5, 4, 3, 3, 3], [10], [8, 10]),
        # one holder: everything forced onto it
        ((0,), [7, 7], [10, 11], [28]),
    ],
)
def test_least_loaded_senders(
    holders: tuple[int, ...], items: list[int], receivers: list[int], expected_loads: list[int]
) -> None:
    nodes = ["src"] * 10 + ["dst"] * 10
    instances = [(dst, [_need(holders, n) for n in items]) for dst in receivers]
    chooser = SenderChooser(nodes)
    chooser.choose(instances)
    assert sorted(chooser.loads[r] for r in holders) == sorted(expected_loads)


def test_same_node_holder_is_preferred_when_loads_allow() -> None:
    nodes = ["a", "b", "b", "a"]  # ranks 0,1 are copies on nodes a,b; 2 lives on b, 3 on a
    chooser = SenderChooser(nodes)
    choices = chooser.choose([(2, [_need((0, 1), 10)]), (3, [_need((0, 1), 10)])])
    assert choices == [[1], [0]]


def test_same_node_preference_yields_to_balance() -> None:
    nodes = ["a", "b", "a", "a"]
    chooser = SenderChooser(nodes)
    chooser.loads[0] = 1000  # the same-node copy is already far busier
    assert chooser.choose([(2, [_need((0, 1), 10)])]) == [[1]]


def test_many_receivers_balance_whole_holder_sets() -> None:
    """With many receivers per holder set a receiver gets all of a set's bytes from one copy."""
    nodes = ["s"] * 2 + ["d"] * 8
    instances = [(2 + i, [_need((0, 1), 30, "a"), _need((0, 1), 10, "b")]) for i in range(8)]
    chooser = SenderChooser(nodes)
    choices = chooser.choose(instances)
    assert all(len(set(c)) == 1 for c in choices)
    assert chooser.loads[:2] == [160, 160]


# ---- buckets and rounds ------------------------------------------------------------------------


def _transfer(src: int, dst: int, nbytes: int, name: str = "w") -> Transfer:
    box = ((0, nbytes),)
    return Transfer(src, dst, name, name, box, name, box, nbytes)


def test_pack_buckets_in_order_up_to_the_limit() -> None:
    ts = [_transfer(0, 1, n, f"t{i}") for i, n in enumerate([40, 30, 30, 50, 10])]
    buckets = pack_buckets(0, 1, ts, 100)
    assert [[t.tensor for t in b.transfers] for b in buckets] == [["t0", "t1", "t2"], ["t3", "t4"]]
    assert [b.nbytes for b in buckets] == [100, 60]


def test_rounds_respect_capacity_and_fan_in() -> None:
    # 6 senders each with 4 buckets of 10 bytes for receiver 6; cap 20, fan-in 2
    queues = [direct_queue(s, 6, pack_buckets(s, 6, [_transfer(s, 6, 10)] * 4, 10)) for s in range(6)]
    rounds = schedule_rounds(queues, 7, cap=20, max_fan_in=2)
    assert sum(len(r) for r in rounds) == 24
    assert len(rounds) == 12  # 240 bytes at 20 per round: the minimum
    for r in rounds:
        assert sum(b.nbytes for b in r) <= 20
        assert len({b.src_rank for b in r}) <= 2


def test_rounds_serve_disjoint_pairs_in_parallel() -> None:
    queues = [
        direct_queue(s, s + 4, pack_buckets(s, s + 4, [_transfer(s, s + 4, 10)] * 3, 10)) for s in range(4)
    ]
    rounds = schedule_rounds(queues, 8, cap=10, max_fan_in=1)
    assert len(rounds) == 3
    assert all(len(r) == 4 for r in rounds)


# ---- configuration and errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"bucket_bytes": 0}, {"staging_budget_bytes": 1}, {"max_fan_in": 0}, {"relay": "sometimes"}],
)
def test_config_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(PlanError):
        PlannerConfig(**kwargs)


def test_bucket_never_exceeds_half_the_staging_budget() -> None:
    config = PlannerConfig(bucket_bytes=1 << 30, staging_budget_bytes=1 << 20)
    assert config.effective_bucket_bytes == 1 << 19


def _sides(model: str, src: str, dst: str) -> tuple:
    manifest = build_manifest(load_model_config(model))
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    return (
        manifest,
        SideSpec("megatron", s, tuple(enumerate_ranks(s, Role.SOURCE))),
        SideSpec("vllm", d, tuple(enumerate_ranks(d, Role.DESTINATION))),
    )


def test_duplicate_coordinates_are_refused() -> None:
    manifest, source, dest = _sides("tiny-llama", "tp=2", "tp=2")
    twice = dataclasses.replace(dest, coords=dest.coords + dest.coords[:1])
    with pytest.raises(TopologyError, match="twice"):
        plan_sync(manifest, source, [twice], PlannerConfig())


def test_no_destination_is_refused() -> None:
    manifest, source, _ = _sides("tiny-llama", "tp=2", "tp=2")
    with pytest.raises(PlanError):
        plan_sync(manifest, source, [], PlannerConfig())


def test_tensor_no_source_rank_holds_is_named() -> None:
    manifest, source, dest = _sides("tiny-llama", "tp=2", "tp=2")

    class Forgetful:
        """The megatron layout, minus the final norm."""

        name = "forgetful"

        def __init__(self, inner: Layout) -> None:
            self.inner = inner

        def validate(self, manifest: Manifest, spec: ParallelSpec) -> None:
            self.inner.validate(manifest, spec)

        def shard(self, manifest: Manifest, spec: ParallelSpec, coord: RankCoord) -> RankShard:
            shard = self.inner.shard(manifest, spec, coord)
            pieces = tuple(p for p in shard.pieces if p.tensor != "model.norm.weight")
            return dataclasses.replace(shard, pieces=pieces)

    from sync_runtime.core.layouts import get_layout

    def lookup(name: str) -> Layout:
        return Forgetful(get_layout("megatron")) if name == "forgetful" else get_layout(name)

    with pytest.raises(LayoutError, match=r"model\.norm\.weight"):
        plan_sync(
            manifest,
            dataclasses.replace(source, layout="forgetful"),
            [dest],
            PlannerConfig(),
            layout_lookup=lookup,
        )


# ---- whole plans: placement and relay choice ---------------------------------------------------


def _placed(spec: ParallelSpec, role: Role, nodes: list[str], layout: str) -> SideSpec:
    coords = enumerate_ranks(spec, role)
    return SideSpec(
        layout, spec, tuple(dataclasses.replace(c, node=n) for c, n in zip(coords, nodes, strict=True))
    )


def test_colocated_copies_send_to_their_own_node() -> None:
    """Two DP copies on nodes a and b, two replicas on a and b: every byte stays on its node."""
    manifest = build_manifest(load_model_config("tiny-llama"))
    source = _placed(ParallelSpec(tp=1, dp=2), Role.SOURCE, ["a", "b"], "hf")
    dest = _placed(ParallelSpec(tp=1, replicas=2), Role.DESTINATION, ["a", "b"], "vllm")
    plan = plan_sync(manifest, source, [dest], PlannerConfig())
    nodes = [c.node for c in plan.ranks]
    assert all(nodes[b.src_rank] == nodes[b.dst_rank] for r in plan.rounds for b in r.buckets)
    assert plan.stats["max_send_bytes"] == plan.stats["mean_send_bytes"]


def test_auto_relay_when_the_source_is_the_bottleneck() -> None:
    manifest = build_manifest(load_model_config("tiny-llama"))
    _, source, _ = _sides("tiny-llama", "tp=2", "tp=2")
    many = SideSpec(
        "vllm",
        ParallelSpec(tp=2, replicas=6),
        tuple(enumerate_ranks(ParallelSpec(tp=2, replicas=6), Role.DESTINATION)),
    )
    config = PlannerConfig(bucket_bytes=4096, staging_budget_bytes=16384)
    off = plan_sync(manifest, source, [many], config)
    auto = plan_sync(manifest, source, [many], dataclasses.replace(config, relay="auto"))
    assert auto.relay and not off.relay
    assert auto.stats["predicted_seconds"] < off.stats["predicted_seconds"]
    assert auto.stats["max_send_bytes"] < off.stats["max_send_bytes"]
    assert auto.digest != off.digest


def test_auto_relay_off_when_destinations_are_the_bottleneck() -> None:
    manifest, source, _ = _sides("tiny-llama", "tp=2,dp=4", "tp=1")
    dest = SideSpec(
        "vllm",
        ParallelSpec(tp=1, replicas=2),
        tuple(enumerate_ranks(ParallelSpec(tp=1, replicas=2), Role.DESTINATION)),
    )
    plan = plan_sync(manifest, source, [dest], PlannerConfig(relay="auto"))
    assert not plan.relay
