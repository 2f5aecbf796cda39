"""vLLM's worker loop waits for its next message without busy-looping while a sync runs in it.

The one private name of vLLM used here is its shared-memory queue's `SpinCondition` (its `wait`,
`is_reader` and `last_read`, read in vLLM 0.31 and 0.32); a vLLM without them keeps its own
behaviour, since this changes only how a worker waits, never what it computes. The other private
names are in vllm_apply.py, behind its version table.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

_quiet_lock = threading.Lock()
_quiet_holders = 0
"""How many `quiet_queue_waits` blocks are open in this process."""
_QUIET_MARK = "weightsync_quiet"
QUIET_SPIN_S = 0.001
"""How long a quiet reader still spins after each read (vLLM's spins a second): messages close
together (a serving engine's steps) keep vLLM's wake-up latency."""
QUIET_POLL_MS = 1
"""After that, the longest a reader sleeps on the notification before it looks at the queue again."""


@contextlib.contextmanager
def quiet_queue_waits() -> Iterator[None]:
    """While the block runs, this process's readers of vLLM's shared-memory message queue wait for
    their next message without busy-looping.

    Why: after each message it reads, a reader of vLLM's queue (`shm_broadcast.SpinCondition`,
    the worker's main loop waiting for its next RPC or step) spins on `sched_yield` for a second
    (`busy_loop_s=1`, no setting) before it sleeps on the writer's notification. A sync's RPCs
    come one after another, so during a transfer the worker's main thread never stops spinning,
    and vLLM's CPU platform binds each worker to its own cores: the spin shares the transfer
    thread's core and takes the GIL between yields (`make bench-vllm`, 2 cores, a warm sync of a
    TP 2 engine: the workers' main threads used 0.19-0.24 CPU-s without this, 0.07 with it, the
    whole sync 1.15-1.29 CPU-s, then 0.94-0.99; measured before the 1 ms spin below). Inside
    the block a reader spins only QUIET_SPIN_S after each read (so that messages close together,
    such as a serving engine's steps, keep its latency), then takes vLLM's own idle path (it
    sleeps on the writer's notification, which every write sends) for at most
    QUIET_POLL_MS at a time: entered soon after a read, that path was measured to miss a wake-up
    (a commit stalled 5 s, until the next message), so the reader looks at the queue again
    after each short poll. Messages and their order are the same; a wake-up after the spin
    costs a socket poll and, at worst, QUIET_POLL_MS. Outside any block vLLM's behaviour is
    untouched. A vLLM whose `SpinCondition` lacks the names read here (`wait`, `is_reader`,
    `last_read`; read in 0.31 and 0.32) keeps its own behaviour.
    """
    global _quiet_holders
    _install_quiet_wait()
    with _quiet_lock:
        _quiet_holders += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_holders -= 1


def _install_quiet_wait() -> None:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    spin = getattr(shm_broadcast, "SpinCondition", None)
    original = getattr(spin, "wait", None)
    if spin is None or original is None or getattr(original, _QUIET_MARK, False):
        return

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        quiet = _quiet_holders and getattr(self, "is_reader", False) and hasattr(self, "last_read")
        if quiet and time.monotonic() - self.last_read > QUIET_SPIN_S:
            self.last_read = -math.inf  # past the busy window: vLLM's idle path, woken by the writer
            timeout_ms = QUIET_POLL_MS if timeout_ms is None else min(timeout_ms, QUIET_POLL_MS)
        original(self, timeout_ms)

    setattr(wait, _QUIET_MARK, True)
    spin.wait = wait
