"""Let a vLLM worker sleep, rather than spin, while it waits for its next call after ours.

vLLM's multiprocess workers read their calls (and, when serving, every step) from a
shared-memory queue (`MessageQueue`). After each read the worker's main thread busy-waits on the
queue for `SpinCondition.busy_loop_s` (1 s) before it sleeps on a zmq notification, so that a
step which follows a step starts without a wake-up. A sync sends each worker about thirty calls
(vLLM's weight-update session: start, update, finish, per WeightSync call), spread over the
sync: the main thread spun through the whole of it, beside WeightSync's transfer thread in the
same process and the sources on the same cores, and for a second after it. Measured with
`make bench-vllm` (TP 2 on this project's 2-core machine): the workers' main threads took 0.25
of the warm sync's 1.48 CPU-seconds, waiting.

After each of its calls the weightsync backend marks the queue's last read as long past
(`quiet_after_call`): the worker then sleeps on the notification, which the writer sends with
every message (`MessageQueue.enqueue` notifies after each write, and a notification sent before
the mark is kept by the socket), so its next call or step wakes it at once. Reads of vLLM's own
(its steps while serving) restart the spin as before.

Private vLLM names, read in 0.31 and 0.32 (the series of `vllm_apply.KNOWN_VLLM`, which the
backend requires before any call reaches this): the worker process object that runs the call
loop holds the queue as `rpc_broadcast_mq` (`WorkerProc`, vllm/v1/executor/multiproc_executor.py),
the queue's `_is_local_reader` and `_spin_condition`, and the condition's `last_read` and
`busy_loop_s` (vllm/distributed/device_communicators/shm_broadcast.py). Where they are missing
(the uniprocess executor and Ray's have no such queue) this does nothing.

The tests' engines run with that window cut to 10 ms for every read (tests/support/quiet_vllm,
to spare the 2-core test machine), so no engine test can see this one: the mechanism is unit
tested (tests/test_vllm_worker_idle.py) and its effect measured by `make bench-vllm`, whose
engine has vLLM's own window (its table: the CPU of the workers' main threads).
"""

from __future__ import annotations

import sys
import time
from typing import Any

_conditions: list[Any] | None = None
"""The spin conditions of the queues this process reads its calls from (found once)."""


def quiet_after_call() -> None:
    """Called in the worker's main thread, inside one of vLLM's calls to the backend: the wait
    for the next call sleeps instead of spinning."""
    global _conditions
    if _conditions is None:
        _conditions = _call_queue_conditions()
    for condition in _conditions:
        condition.last_read = time.monotonic() - 2 * condition.busy_loop_s - 1.0


def _call_queue_conditions() -> list[Any]:
    """The spin condition of the queue the running call came through: the `rpc_broadcast_mq` of
    the object whose loop (up the stack) dequeued it; [] when no frame holds one."""
    frame = sys._getframe(1)
    while frame is not None:
        queue = getattr(frame.f_locals.get("self"), "rpc_broadcast_mq", None)
        condition = getattr(queue, "_spin_condition", None)
        if getattr(queue, "_is_local_reader", False) and hasattr(condition, "last_read"):
            return [condition] if hasattr(condition, "busy_loop_s") else []
        frame = frame.f_back
    return []
