"""The test servers' ports: drawn below the kernel's ephemeral range, free when drawn."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from sync_runtime.testing import ports

pytestmark = pytest.mark.unit


def test_a_port_is_below_the_ephemeral_range_and_free() -> None:
    low = ports._ephemeral_low()
    drawn = {ports.free_port() for _ in range(20)}
    assert all(low - ports._SPAN <= p < low for p in drawn), drawn
    assert len(drawn) > 1  # drawn at random, not one fixed port
    for p in drawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # raises if something held it


def test_a_held_port_is_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        draws = itertools.chain([taken, taken], itertools.count(20000))

        class Draw:
            def randrange(self, a: int, b: int) -> int:
                return next(draws)

        monkeypatch.setattr(ports.random, "SystemRandom", Draw)
        assert ports.free_port() != taken


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    narrow = tmp_path / "range"
    narrow.write_text("2000\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", narrow)
    assert ports._ephemeral_low() == 2000
    assert ports.free_port() >= 1024


def test_a_port_held_on_another_loopback_address_is_not_free() -> None:
    # a server pod of the test control plane listens on its own 127.0.0.N
    with socket.socket() as held:
        held.bind(("127.0.0.5", 0))
        held.listen()
        assert not ports._bindable(held.getsockname()[1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert ports._bindable(free)  # control: released, free again
