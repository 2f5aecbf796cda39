"""The digest a sync's ranks agree on covers the sync's encoding (planner/digest.py sync_digest):
which destination replicas take deltas, from which base version, in which format. Two ranks that
disagree on any of it disagree on the digest, so the group refuses the sync before the first byte.
"""

from __future__ import annotations

import pytest

from sync_runtime.planner.digest import sync_digest
from sync_runtime.transfer.delta_wire import FORMAT, agreed

pytestmark = pytest.mark.unit

PLAN = "ab" * 32
DIRECT = 1 << 20
REPLICA0, REPLICA1 = (2, 3), (4, 5)  # destination ranks of two tp=2 replicas


def bases(version: str, *replicas: tuple[int, ...]) -> dict[int, str]:
    return {rank: version for replica in replicas for rank in replica}


def test_same_decision_same_digest_whatever_the_order() -> None:
    one = sync_digest(PLAN, DIRECT, FORMAT, {2: "v1", 3: "v1", 4: "v1", 5: "v1"})
    other = sync_digest(PLAN, DIRECT, FORMAT, {5: "v1", 4: "v1", 3: "v1", 2: "v1"})
    assert one == other and len(one) == 64


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ({}, bases("v1", REPLICA0, REPLICA1)),  # every replica in full vs every replica as deltas
        (bases("v1", REPLICA0), bases("v1", REPLICA1)),  # which replica takes deltas
        (bases("v1", REPLICA0), bases("v1", REPLICA0, REPLICA1)),  # one replica more
        (bases("v1", REPLICA0), bases("v2", REPLICA0)),  # the base version
        (bases("v1", REPLICA0), {2: "v1"}),  # one rank of the replica in full (never planned so)
    ],
    ids=["full-vs-delta", "which-replica", "one-more-replica", "base-version", "half-a-replica"],
)
def test_a_different_encoding_is_a_different_digest(left: dict[int, str], right: dict[int, str]) -> None:
    assert sync_digest(PLAN, DIRECT, FORMAT, left) != sync_digest(PLAN, DIRECT, FORMAT, right)


def test_plan_threshold_and_format_are_covered() -> None:
    base = bases("v1", REPLICA0)
    reference = sync_digest(PLAN, DIRECT, FORMAT, base)
    assert sync_digest("cd" * 32, DIRECT, FORMAT, base) != reference
    assert sync_digest(PLAN, DIRECT * 2, FORMAT, base) != reference
    assert sync_digest(PLAN, DIRECT, FORMAT + "x", base) != reference
    # A full sync does not depend on the delta format (no message is in it).
    assert sync_digest(PLAN, DIRECT, FORMAT, {}) == sync_digest(PLAN, DIRECT, FORMAT + "x", {})


def test_the_transfer_engine_agrees_on_the_sync_digest() -> None:
    """delta_wire.agreed (what run_rank_plan hands the group before the first byte) is it."""
    base = bases("v3", REPLICA1)
    assert agreed(PLAN, DIRECT, base) == sync_digest(PLAN, DIRECT, FORMAT, base)
    assert agreed(PLAN, DIRECT, base) != agreed(PLAN, DIRECT, {})
