"""start_local_ray starts Ray again when Ray gave up waiting for its raylet, and only then."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sync_runtime.testing import cluster

pytestmark = pytest.mark.unit


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures, self.inits, self.shutdowns, self.up = failures, 0, 0, False

    def is_initialized(self) -> bool:
        return self.up

    def init(self, **_: Any) -> None:
        self.inits += 1
        if self.failures:
            raise self.failures.pop(0)
        self.up = True

    def shutdown(self) -> None:
        self.shutdowns += 1

    def get_runtime_context(self) -> Any:
        return SimpleNamespace(gcs_address="127.0.0.1:1")


def test_a_raylet_timeout_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay([Exception(cluster.RAYLET_TIMEOUT + ". This could happen ...")])
    monkeypatch.setattr(cluster, "ray", fake)
    assert cluster.start_local_ray() == "127.0.0.1:1"
    assert (fake.inits, fake.shutdowns) == (2, 1)


def test_other_failures_and_a_third_timeout_are_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay([ValueError("bad argument")])
    monkeypatch.setattr(cluster, "ray", fake)
    with pytest.raises(ValueError):
        cluster.start_local_ray()
    assert fake.inits == 1  # control: not retried
    fake = FakeRay([Exception(cluster.RAYLET_TIMEOUT)] * 3)
    monkeypatch.setattr(cluster, "ray", fake)
    with pytest.raises(Exception, match=cluster.RAYLET_TIMEOUT):
        cluster.start_local_ray()
    assert fake.inits == 3
