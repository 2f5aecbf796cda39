"""Topology parsing, PP stage splits and the canonical rank enumeration."""

import pytest

from sync_runtime.core.topology import (
    ParallelSpec,
    Role,
    enumerate_ranks,
    source_expert_coords,
    stage_layer_ranges,
)
from sync_runtime.errors import TopologyError

pytestmark = pytest.mark.unit


def test_parse_round_trip() -> None:
    spec = ParallelSpec.parse("tp=8, pp=8, dp=4, ep=32, etp=1")
    assert (spec.tp, spec.pp, spec.dp, spec.ep, spec.etp) == (8, 8, 4, 32, 1)
    assert spec.world_size == 256
    assert spec.edp == 1
    assert ParallelSpec.parse(spec.describe()) == spec


def test_parse_layer_counts() -> None:
    spec = ParallelSpec.parse("pp=3,layers=3+2+2")
    assert spec.layer_counts == (3, 2, 2)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tp=0", "tp=0: must be an integer >= 1"),
        ("tp=two", "tp must be an integer"),
        ("zp=2", "unknown key 'zp'"),
        ("tp", "expected key=value"),
        ("pp=2,layers=1+1+1", "layer_counts has 3 entries, pp=2"),
    ],
)
def test_parse_errors_name_the_field(text: str, fragment: str) -> None:
    with pytest.raises(TopologyError, match=fragment):
        ParallelSpec.parse(text)


def test_uneven_stage_split_gives_extra_layers_to_first_stages() -> None:
    assert [len(r) for r in stage_layer_ranges(61, 8)] == [8, 8, 8, 8, 8, 7, 7, 7]
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(5, 2, (1, 4)) == [range(0, 1), range(1, 5)]


def test_stage_split_errors() -> None:
    with pytest.raises(TopologyError, match="more stages than the model's 2 layers"):
        stage_layer_ranges(2, 3)
    with pytest.raises(TopologyError, match="sum to 4, the model has 5"):
        stage_layer_ranges(5, 2, (2, 2))


def test_source_enumeration_is_megatron_order() -> None:
    spec = ParallelSpec(tp=2, pp=2, dp=2, ep=4)
    coords = enumerate_ranks(spec, Role.SOURCE, gpus_per_node=4)
    assert len(coords) == 8
    assert [(c.pp_rank, c.dp_rank, c.tp_rank) for c in coords[:4]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    assert [c.ep_rank for c in coords[:4]] == [0, 1, 2, 3]
    assert coords[4].node == "source-node-1" and coords[4].device == "cuda:0"


def test_expert_coords_with_etp_and_edp() -> None:
    spec = ParallelSpec(tp=4, dp=2, ep=2, etp=2)
    assert spec.edp == 2
    seen = {source_expert_coords(spec, tp, dp) for dp in range(2) for tp in range(4)}
    assert seen == {(ep, etp, edp) for ep in range(2) for etp in range(2) for edp in range(2)}


def test_destination_enumeration_replicas_outermost() -> None:
    spec = ParallelSpec(tp=2, pp=2, ep=2, replicas=2)
    coords = enumerate_ranks(spec, Role.DESTINATION)
    assert [(c.replica, c.pp_rank, c.tp_rank, c.ep_rank) for c in coords[:4]] == [
        (0, 0, 0, 0),
        (0, 0, 1, 1),
        (0, 1, 0, 0),
        (0, 1, 1, 1),
    ]
    assert coords[4].replica == 1
    assert len({c.key for c in coords}) == len(coords)
