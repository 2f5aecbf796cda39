"""transfer/spans.py: the per-process phase tallies the vllm-server bench breaks a sync down with."""

from __future__ import annotations

import threading
import time

import pytest

from sync_runtime.transfer import spans

pytestmark = pytest.mark.unit


def test_span_accounts_wall_cpu_and_calls_and_take_resets() -> None:
    spans.take()
    with spans.span("sleep"):
        time.sleep(0.05)
    with spans.span("sleep"):
        pass
    deadline = time.thread_time() + 0.05
    with spans.span("spin"):
        while time.thread_time() < deadline:
            pass
    got = spans.take()
    assert got["sleep"]["calls"] == 2
    # time.sleep and perf_counter may read different clocks: a 50 ms sleep can measure 49.99 ms
    assert got["sleep"]["wall_s"] >= 0.045
    assert got["sleep"]["cpu_s"] < 0.04  # a sleeping thread burns no CPU: wall - cpu is the wait
    assert got["spin"]["cpu_s"] >= 0.045  # the deadline was read just before the span began
    assert spans.take() == {}


def test_span_counts_a_block_that_raises() -> None:
    spans.take()
    with pytest.raises(ValueError), spans.span("fails"):
        raise ValueError("x")
    assert spans.take()["fails"]["calls"] == 1


def test_spans_of_concurrent_threads_add_up() -> None:
    spans.take()

    def work() -> None:
        for _ in range(1000):
            spans.add("t", 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = spans.take()["t"]
    assert got["calls"] == 4000
    assert got["wall_s"] == pytest.approx(4.0)


def test_take_from_reads_this_process() -> None:
    spans.take()
    spans.add("x", 1.0, 0.5)
    assert spans.take_from(object()) == {"x": {"wall_s": 1.0, "cpu_s": 0.5, "calls": 1}}
