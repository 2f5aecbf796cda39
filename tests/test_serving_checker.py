"""The serving checker of the commit-fault trials finds a mix, and only a real one (no Ray)."""

from __future__ import annotations

import pytest

from sync_runtime.core.topology import Role, enumerate_ranks
from sync_runtime.testing.cluster import DemoSetup
from sync_runtime.testing.serving_checker import ServingChecker

pytestmark = pytest.mark.unit


def _checker() -> tuple[ServingChecker, str, str]:
    setup = DemoSetup.create("tiny-llama", "tp=2", "tp=2", seed=1)
    coords = list(enumerate_ranks(setup.dst, Role.DESTINATION))
    checker = ServingChecker(setup, coords, {"a", "b"})
    x, y = (checker._name(c) for c in coords)
    return checker, x, y


def test_a_serving_mix_is_found() -> None:
    checker, x, y = _checker()
    checker._readings = {
        x: [("a", True, False, {}, 1.0), ("b", True, False, {}, 2.0)],
        y: [("a", True, False, {}, 1.5), ("a", True, False, {}, 2.5)],  # still on "a" at t=2
    }
    assert len(checker.mixes()) == 1


def test_pause_commit_resume_is_not_a_mix() -> None:
    checker, x, y = _checker()
    checker._readings = {
        x: [("a", True, False, {}, 1.0), ("a", False, False, {}, 2.0), ("b", True, False, {}, 4.0)],
        y: [("a", True, False, {}, 1.5), ("b", False, False, {}, 3.0), ("b", True, False, {}, 4.5)],
    }
    assert checker.mixes() == []


def test_a_misnamed_or_poisoned_serving_rank_is_found() -> None:
    checker, x, _ = _checker()
    assert checker._misnamed(x, ("a", True, False, {"w": "0"}, 1.0))
    assert checker._misnamed(x, ("zz", True, False, {}, 1.0))
    assert checker._misnamed(x, ("a", True, True, {}, 1.0))
    assert checker._misnamed(x, ("a", False, True, {}, 1.0)) == []
