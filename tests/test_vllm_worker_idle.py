"""engines/vllm_worker_idle.py: after a WeightSync call, the queue the call came through is
marked as read long ago (vLLM's reader then sleeps instead of spinning); nothing is touched
where no frame up the stack holds a reader queue. The real worker: tests/engines/test_vllm_plugin.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from sync_runtime.engines import vllm_worker_idle

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    vllm_worker_idle._conditions = None  # found once per process: each test finds its own
    yield
    vllm_worker_idle._conditions = None


def _queue(reader: bool) -> SimpleNamespace:
    condition = SimpleNamespace(last_read=time.monotonic(), busy_loop_s=1.0)
    return SimpleNamespace(_is_local_reader=reader, _spin_condition=condition)


class _Loop:
    """Stands for vLLM's WorkerProc: its loop dequeues a call and runs it."""

    def __init__(self, reader: bool = True) -> None:
        self.rpc_broadcast_mq = _queue(reader)

    def run_call(self) -> None:
        vllm_worker_idle.quiet_after_call()


def test_the_queue_the_call_came_through_is_marked_read_long_ago() -> None:
    loop = _Loop()
    condition = loop.rpc_broadcast_mq._spin_condition
    loop.run_call()
    assert time.monotonic() - condition.last_read > condition.busy_loop_s  # past the spin window
    condition.last_read = time.monotonic()  # vLLM read its next call: it spins again
    loop.run_call()  # found once, marked again
    assert time.monotonic() - condition.last_read > condition.busy_loop_s


def test_a_writer_queue_is_left_alone() -> None:
    loop = _Loop(reader=False)  # the executor's side of the queue: it never waits on reads
    before = loop.rpc_broadcast_mq._spin_condition.last_read
    loop.run_call()
    assert loop.rpc_broadcast_mq._spin_condition.last_read == before
    assert vllm_worker_idle._conditions == []


def test_without_a_call_loop_up_the_stack_nothing_is_touched() -> None:
    vllm_worker_idle.quiet_after_call()  # vLLM's uniprocess executor: no queue
    assert vllm_worker_idle._conditions == []
