"""Waiting on posted messages with deadlines while watching for a peer's failure.

gloo's `Work.wait(timeout)` completes the Work even when it times out, so a Work cannot be
waited on in short slices. One helper thread per sync therefore waits the posted Works in
posting order, each until its own deadline, and queues every completion; the engine's thread
takes completions as they come (unpacking a bucket while the next is still on the wire) and,
while none comes, polls the store's failure flag, so a failure elsewhere ends this rank's wait
within one poll interval instead of after timeout_s.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_DEADLINE_SLACK_S = 0.05
"""The transport rounds a wait's timeout to milliseconds: a wait that failed this close to its
deadline timed out."""

Key = tuple[str, int]
"""("recv", bucket index), ("send", bucket index), or ("round", 0) for a coalesced NCCL round."""


@dataclass(frozen=True, slots=True)
class Message:
    """One posted message (or a coalesced round): what to say about it when it fails."""

    round_index: int
    key: Key
    description: str
    """e.g. "recv from rank 3 (4096 bytes)"."""
    deadline: float
    peer: int | None = None
    """The rank at the other end; None for a coalesced round (several peers)."""


@dataclass(frozen=True, slots=True)
class Completion:
    message: Message
    error: str | None
    """None when the message completed; otherwise the transport's error text (for the message only)."""
    timed_out: bool = False
    """The wait failed at its deadline (told by the clock where the transport raised, since gloo
    and NCCL raise the same exception type for a timeout as for a broken connection)."""


class MessageWaiter:
    """A helper thread waiting Works in posting order; completions come out of `next()`."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pending: queue.SimpleQueue[tuple[dist.Work, Message] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._abandoned = False
        self.thread = threading.Thread(target=self._run, name="weightsync-wait", daemon=True)
        self.thread.start()

    def add(self, work: dist.Work, message: Message) -> None:
        self._pending.put((work, message))

    def stop(self) -> None:
        self._pending.put(None)

    def abandon(self) -> None:
        """After a failure: wait on nothing more than the Work already being waited on."""
        self._abandoned = True
        self._pending.put(None)

    def next(self, timeout_s: float) -> Completion | None:
        try:
            return self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # NCCL's wait synchronizes on this thread's device
        while (item := self._pending.get()) is not None and not self._abandoned:
            work, message = item
            remaining = max(message.deadline - time.monotonic(), 0.001)
            try:
                work.wait(timedelta(seconds=remaining))
            except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with transport text
                text = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._done.put(Completion(message, text, timed_out=_past(message.deadline)))
                return  # the sync is lost; the Works behind this one are the group's to drop
            self._done.put(Completion(message, None))


def _past(deadline: float) -> bool:
    return time.monotonic() >= deadline - _DEADLINE_SLACK_S
