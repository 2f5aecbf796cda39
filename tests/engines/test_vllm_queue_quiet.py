"""`vllm_quiet.quiet_queue_waits` on vLLM's real shared-memory queue condition (`SpinCondition`).

A reader of vLLM's queue spins for `busy_loop_s` after each read. Inside the block it must wait
without spinning (its thread's CPU over a stretch of waits is a small part of the stretch, where
outside the block it is most of it: the control), still be woken by the writer's notification,
and take vLLM's behaviour back once the block ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from sync_runtime.engines import vllm_quiet

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

STRETCH_S = 0.3


Pair = tuple[SpinCondition, SpinCondition]


@pytest.fixture
def pair() -> Iterator[Pair]:
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    reader.busy_loop_s = 1.0  # vLLM's default (the test session's site shortens it)
    time.sleep(0.2)  # the subscription reaches the writer
    yield writer, reader
    context.destroy(linger=0)


def _cpu_share_of_waits(reader: SpinCondition) -> float:
    """Waits for STRETCH_S right after a read, as vLLM's reader loop does: its thread's CPU share."""
    reader.record_read()
    wall, cpu = time.monotonic(), time.thread_time()
    while time.monotonic() - wall < STRETCH_S:
        reader.wait(timeout_ms=1000)
    return (time.thread_time() - cpu) / (time.monotonic() - wall)


def test_a_reader_waits_without_spinning_inside_the_block_only(pair: Pair) -> None:
    writer, reader = pair
    spinning = _cpu_share_of_waits(reader)
    with vllm_quiet.quiet_queue_waits():
        quiet = _cpu_share_of_waits(reader)
        writer.notify()
        woke = time.monotonic()
        reader.wait(timeout_ms=2000)  # the notification ends the wait at once
        assert time.monotonic() - woke < 0.5
    after = _cpu_share_of_waits(reader)
    assert spinning > 0.5, spinning  # the control: vLLM's busy window holds the core
    assert quiet < 0.2, quiet
    assert after > 0.5, after
    assert vllm_quiet._quiet_holders == 0


def test_blocks_nest_and_a_failing_block_lets_go() -> None:
    with vllm_quiet.quiet_queue_waits(), vllm_quiet.quiet_queue_waits():
        assert vllm_quiet._quiet_holders == 2
    with pytest.raises(RuntimeError), vllm_quiet.quiet_queue_waits():
        raise RuntimeError("a failed transfer")
    assert vllm_quiet._quiet_holders == 0
    assert getattr(SpinCondition.wait, vllm_quiet._QUIET_MARK)  # installed once, kept
