"""The shared-engine pool of tests/engines (tests/support/shared_engines.py), with stand-in
engines: it starts one per name, reuses it while healthy, starts another after a test retired
it or it died, and stops it after the session's last test that uses it."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tests.support import shared_engines as se

pytestmark = pytest.mark.unit


@dataclass
class Engines:
    """Stand-in engines: numbered in start order; which are stopped, which died."""

    started: int = 0
    stopped: list[int] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)

    def start(self) -> int:
        self.started += 1
        return self.started

    def healthy(self, engine: int) -> bool:
        return engine not in self.dead


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> se.SharedEngines:
    monkeypatch.setattr(se, "PENDING", {"pair": {"a::t1", "b::t1", "b::t2"}})
    monkeypatch.setattr(se, "STARTS", {})
    return se.SharedEngines()


def _use(pool: se.SharedEngines, engines: Engines) -> int:
    with pool.use("pair", engines.start, engines.stopped.append, engines.healthy) as engine:
        return engine


def test_a_healthy_engine_is_reused_and_stopped_after_its_last_test(pool: se.SharedEngines) -> None:
    engines = Engines()
    assert _use(pool, engines) == 1
    pool.finished("a::t1")
    assert _use(pool, engines) == 1 and engines.stopped == []  # the next module: the same engine
    pool.finished("b::t1")
    pool.finished("b::t2")
    assert engines.stopped == [1] and se.STARTS == {"pair": 1}


def test_a_retired_or_dead_engine_is_started_again(pool: se.SharedEngines) -> None:
    engines = Engines()
    assert _use(pool, engines) == 1
    pool.retire("pair")  # a test killed it on purpose
    assert engines.stopped == [1]
    assert _use(pool, engines) == 2
    engines.dead.add(2)  # died on its own: the next user's health check finds it
    assert _use(pool, engines) == 3
    assert engines.stopped == [1, 2] and se.STARTS == {"pair": 3}


@dataclass
class Item:
    """What group_modules reads of a collected test: its module and node id."""

    module: object
    nodeid: str


def _modules(retiring: bool) -> list[Item]:
    a = SimpleNamespace(__name__="a", **({"RETIRES_SHARED": ("pair",)} if retiring else {}))
    b, c = (SimpleNamespace(__name__=n) for n in "bc")
    return [Item(a, "a::t1"), Item(a, "a::t2"), Item(b, "b::t1"), Item(c, "c::t1")]


@pytest.mark.parametrize("retiring", [True, False])
def test_a_module_that_retires_a_shared_engine_runs_last_of_its_users(
    monkeypatch: pytest.MonkeyPatch, retiring: bool
) -> None:
    monkeypatch.setattr(se, "USERS", {"pair": {"a", "c"}})
    items = _modules(retiring)
    se.group_modules(items, ["pair"])  # type: ignore[arg-type]  # stand-in items
    got = [i.nodeid for i in items]
    # c joins a's group either way; a goes after it only when it retires the engine (control)
    assert got == (["c::t1", "a::t1", "a::t2", "b::t1"] if retiring else ["a::t1", "a::t2", "c::t1", "b::t1"])
