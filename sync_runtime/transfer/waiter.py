"""Waiting on a round's messages with a deadline while watching for a peer's failure.

gloo's `Work.wait(timeout)` completes the Work even when it times out, so a Work cannot be
waited on in short slices; the waits run in a helper thread with the round's deadline, and the
calling thread polls the store's failure flag meanwhile. A failure elsewhere therefore ends
this rank's wait within one poll interval instead of after timeout_s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sync_runtime.transfer.config import TransferError


@dataclass(frozen=True, slots=True)
class Message:
    """One posted message: what to say about it when it fails."""

    direction: str  # "send to" / "recv from"
    peer: int
    nbytes: int


class RoundWaiter:
    def __init__(self, works: list[dist.Work], messages: list[Message], deadline: float) -> None:
        # NCCL returns one Work for the whole coalesced round: it then stands for every message.
        self._works = works
        self._messages = messages
        self._deadline = deadline
        self.failed_index: int | None = None
        self.failure: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightsync-round-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i, work in enumerate(self._works):
            remaining = max(self._deadline - time.monotonic(), 0.001)
            try:
                work.wait(timedelta(seconds=remaining))
            except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with transport text
                self.failed_index, self.failure = i, str(e).splitlines()[0] if str(e) else type(e).__name__
                break
        self._done.set()

    def wait(
        self,
        *,
        rank: int,
        round_index: int,
        timeout_s: float,
        poll_s: float,
        peer_failure: Callable[[], tuple[int, str] | None],
    ) -> None:
        """Return when every message completed; raise TransferError naming rank, round, peer, step."""
        while not self._done.wait(poll_s):
            self._raise_if_peer_failed(rank, round_index, peer_failure)
            if time.monotonic() > self._deadline + 2 * poll_s:
                break  # the helper is stuck past its own deadline; report the timeout anyway
        if self._done.is_set() and self.failure is None:
            return
        # A transport error is often the echo of a peer's failure (it closed its connections):
        # name the root cause when the peer published one.
        self._raise_if_peer_failed(rank, round_index, peer_failure)
        index = self.failed_index if self.failed_index is not None else 0
        msg = self._messages[index] if len(self._works) == len(self._messages) else None
        peer_text = (
            f"{msg.direction} rank {msg.peer} ({msg.nbytes} bytes)" if msg else f"peers {self._peers()}"
        )
        timed_out = self.failure is None or "timed out" in self.failure.lower()
        reason = f"timed out after {timeout_s:.1f}s" if timed_out else self.failure
        raise TransferError(f"rank {rank}: round {round_index}: {peer_text} failed (step transfer): {reason}")

    def _raise_if_peer_failed(
        self, rank: int, round_index: int, peer_failure: Callable[[], tuple[int, str] | None]
    ) -> None:
        failure = peer_failure()
        if failure is not None:
            who, why = failure
            raise TransferError(
                f"rank {rank}: aborted in round {round_index} (step transfer) waiting on peers "
                f"{self._peers()}: peer rank {who} failed: {why}"
            )

    def _peers(self) -> list[int]:
        return sorted({m.peer for m in self._messages})

    @property
    def thread(self) -> threading.Thread:
        return self._thread
