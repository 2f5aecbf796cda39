"""The link cost model on hand-made plans (see sync_runtime/cost.py for the model)."""

from __future__ import annotations

import pytest

from sync_runtime.core.cost import LinkCost, floor_seconds, predict_seconds
from sync_runtime.core.plan import Bucket, Round, SyncPlan
from sync_runtime.core.topology import RankCoord, Role

pytestmark = pytest.mark.unit

COST = LinkCost(nic_bytes_per_s=100.0, intra_node_bytes_per_s=1000.0, latency_s=0.5)


def _plan(nodes: list[str], rounds: list[list[tuple[int, int, int]]]) -> SyncPlan:
    ranks = tuple(
        RankCoord(role=Role.SOURCE if i == 0 else Role.DESTINATION, tp_rank=i, node=n)
        for i, n in enumerate(nodes)
    )
    return SyncPlan(
        ranks=ranks,
        rounds=tuple(Round(tuple(Bucket(s, d, (), n) for s, d, n in r)) for r in rounds),
        digest="x",
    )


@pytest.mark.parametrize(
    ("nodes", "rounds", "predicted", "floor"),
    [
        # one inter-node bucket of 1000 bytes: 10 s on the NIC + 2 messages (send and recv sides
        # are different ranks: 1 message each) * 0.5 s
        (["a", "b"], [[(0, 1, 1000)]], 10.0 + 0.5, 10.0),
        # same node: the intra-node link, 1 s, plus latency
        (["a", "a"], [[(0, 1, 1000)]], 1.0 + 0.5, 10.0),
        # rank 0 sends two buckets in one round: 20 s + 2 messages
        (["a", "b", "c"], [[(0, 1, 1000), (0, 2, 1000)]], 20.0 + 1.0, 10.0),
        # rounds add up; each round is as slow as its slowest rank
        (["a", "b", "c"], [[(0, 1, 1000)], [(0, 2, 500)]], 10.5 + 5.5, 10.0),
        # send and receive overlap on one rank (full duplex): max, not sum
        (["a", "b", "c"], [[(0, 1, 1000), (1, 2, 1000)]], 10.0 + 1.0, 10.0),
        # NIC and intra-node traffic of one rank add up
        (["a", "a", "b"], [[(0, 1, 1000), (0, 2, 1000)]], 10.0 + 1.0 + 1.0, 10.0),
    ],
)
def test_predict_and_floor(
    nodes: list[str], rounds: list[list[tuple[int, int, int]]], predicted: float, floor: float
) -> None:
    plan = _plan(nodes, rounds)
    assert predict_seconds(plan, COST) == pytest.approx(predicted)
    assert floor_seconds(plan, COST) == pytest.approx(floor)


def test_empty_plan_costs_nothing() -> None:
    plan = _plan(["a", "b"], [])
    assert predict_seconds(plan, COST) == 0.0
    assert floor_seconds(plan, COST) == 0.0


def test_defaults_are_400_gbps_nics() -> None:
    plan = _plan(["a", "b"], [[(0, 1, 50 * 10**9)]])
    assert floor_seconds(plan) == pytest.approx(1.0)
    assert predict_seconds(plan) == pytest.approx(1.0 + 20e-6)  # one message per rank


@pytest.mark.parametrize(
    "kwargs", [{"nic_bytes_per_s": 0}, {"intra_node_bytes_per_s": -1}, {"latency_s": -1}]
)
def test_link_cost_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LinkCost(**kwargs)
