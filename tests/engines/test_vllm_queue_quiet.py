"""`vllm_quiet.quiet_queue_waits` on vLLM's real shared-memory queue condition (`SpinCondition`).

A reader of vLLM's queue spins (`sched_yield` in a loop) for `busy_loop_s` after each read. Inside
the block it spins only QUIET_SPIN_S after a read, then waits without spinning: no yield at all,
each wait a sleep on the writer's notification of at most QUIET_POLL_MS (not the caller's whole
timeout), ended at once by a notification; outside the block it spins as vLLM does (the
control), also after the block ended.
Counted, not timed: the suite runs beside another lane on two cores, where a spinning reader's CPU
share depends on what else runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from sync_runtime.engines import vllm_quiet

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

Pair = tuple[SpinCondition, SpinCondition]
WAITS = 20


@pytest.fixture
def pair() -> Iterator[Pair]:
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    reader.busy_loop_s = 60.0  # vLLM's window is 1 s (the test session's site shortens it): ample
    time.sleep(0.2)  # the subscription reaches the writer
    yield writer, reader
    context.destroy(linger=0)


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a reader yielded (vLLM's busy loop), counted in vLLM's own module."""
    count = [0]
    real = shm_broadcast.sched_yield

    def counted() -> None:
        count[0] += 1
        real()

    monkeypatch.setattr(shm_broadcast, "sched_yield", counted)
    return count


def _waits(reader: SpinCondition, after_s: float = 0.0) -> float:
    """WAITS waits `after_s` after a read, as vLLM's reader loop does; the longest one (s)."""
    reader.record_read()
    time.sleep(after_s)
    longest = 0.0
    for _ in range(WAITS):
        t0 = time.monotonic()
        reader.wait(timeout_ms=5000)
        longest = max(longest, time.monotonic() - t0)
    return longest


def test_a_reader_waits_without_spinning_inside_the_block_only(
    pair: Pair, yields: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = pair
    past_spin = 2 * vllm_quiet.QUIET_SPIN_S
    _waits(reader, after_s=past_spin)
    spun = yields[0]
    with vllm_quiet.quiet_queue_waits():
        longest = _waits(reader, after_s=past_spin)
        quiet = yields[0] - spun
        writer.notify()
        woke = time.monotonic()
        reader.wait(timeout_ms=5000)  # the notification ends the wait at once
        assert time.monotonic() - woke < 2.0
        # within QUIET_SPIN_S of a read (a serving step's gap) a quiet reader still spins; the
        # window is widened here so that a loaded machine cannot make the check miss it
        monkeypatch.setattr(vllm_quiet, "QUIET_SPIN_S", 60.0)
        reader.record_read()
        reader.wait(timeout_ms=5000)
        in_window = yields[0] - spun - quiet
        monkeypatch.setattr(vllm_quiet, "QUIET_SPIN_S", past_spin / 2)
    _waits(reader, after_s=past_spin)
    assert spun == WAITS  # the control: outside the block every wait is one turn of vLLM's spin
    assert quiet == 0
    assert in_window == 1
    assert longest < 2.0, longest  # each quiet wait is a short poll, not the caller's 5 s timeout
    assert yields[0] - spun - in_window == WAITS  # vLLM's behaviour is back
    assert vllm_quiet._quiet_holders == 0


def test_blocks_nest_and_a_failing_block_lets_go() -> None:
    with vllm_quiet.quiet_queue_waits(), vllm_quiet.quiet_queue_waits():
        assert vllm_quiet._quiet_holders == 2
    with pytest.raises(RuntimeError), vllm_quiet.quiet_queue_waits():
        raise RuntimeError("a failed transfer")
    assert vllm_quiet._quiet_holders == 0
    assert getattr(SpinCondition.wait, vllm_quiet._QUIET_MARK)  # installed once, kept
