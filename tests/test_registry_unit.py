"""The registry's table (the actor class run in-process) and register()'s argument checks."""

from __future__ import annotations

import pytest

from sync_runtime.runtime import registry
from sync_runtime.runtime.registry import _Registry

pytestmark = pytest.mark.unit


def test_table_keeps_one_entry_per_actor_and_deployments_apart() -> None:
    r = _Registry()
    assert r.add("trainer", [("b2", "t1", "h1"), ("a1", "t0", "h0")]) == 2
    assert r.add("trainer", [("b2", "t1-again", "h1")]) == 2  # same actor id: replaced, not added
    assert r.add("rollout", [("c3", "r0", "h2")]) == 1
    assert r.entries("trainer") == [("a1", "t0", "h0"), ("b2", "t1-again", "h1")]  # actor-id order
    assert r.entries("nobody") == []
    assert r.remove("trainer", ["b2", "zz"]) == 1
    assert r.entries("trainer") == [("a1", "t0", "h0")]
    assert r.remove("rollout", None) == 1 and r.entries("rollout") == []


class _Id:
    def __init__(self, h: str) -> None:
        self._h = h

    def hex(self) -> str:
        return self._h


class _Handle:
    def __init__(self, h: str) -> None:
        self._actor_id = _Id(h)


def test_entries_name_registered_actors() -> None:
    handles = [_Handle("0123456789abcdef0123"), _Handle("ffffffffffffffffffff")]
    out = registry._entries("trainer", handles, None)
    assert [(a, n) for a, n, _ in out] == [
        ("0123456789abcdef0123", "trainer@0123456789ab"),
        ("ffffffffffffffffffff", "trainer@ffffffffffff"),
    ]
    named = registry._entries("trainer", handles[0], ["rank-0"])
    assert [(a, n) for a, n, _ in named] == [("0123456789abcdef0123", "rank-0")]
    with pytest.raises(ValueError, match="1 names for 2 actors"):
        registry._entries("trainer", handles, ["only-one"])
