"""One vLLM engine, N destination ranks: the per-rank calls of one method batched into one call.

Discovery turns an actor whose `ws_meta()` returns a list into one rank handle per entry
(runtime/discovery.RankHandle); each handle's calls arrive as `ws_rank_call(index, method, args)`.
An engine can only be driven as a whole (vLLM's collective_rpc and its weight-transfer calls
reach every worker at once, and cannot run concurrently on one engine), and ranks that
rendezvous with each other (ws_join, ws_run) must be inside the same call. So the calls the
ranks make for one method are gathered here and dispatched together by the subclass's `_rpc`.
Used by `VllmReplica` (our own actor, collective_rpc) and `VllmEngineRanks` (any vLLM with the
weightsync backend, driven through vLLM's own weight-transfer API).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sync_runtime.errors import DestinationError, ParticipantDied, WeightSyncError

RENDEZVOUS = frozenset({"ws_join", "ws_run"})
"""Methods whose ranks block on each other: wait for every local rank before dispatching."""
RENDEZVOUS_WAIT_S = 30.0
GATHER_WINDOW_S = 0.05
"""Other methods: dispatch what arrived within this window (a rank called alone still runs)."""
RESUME_WINDOW_S = 2.0
"""`ws_resume`: the commit phase resumes every rank of an engine at once (runtime/commit.py),
and the engine resumes only if all hold one version, so a resume waits longer for the rest: a
rank left out is one whose replica does not hold one version (a failure path, never the
common one), and a resume split in two would keep a data-parallel server paused."""


def gather_seconds(method: str) -> float:
    """How long a batch of `method` waits for the engine's other ranks before it dispatches."""
    if method in RENDEZVOUS:
        return RENDEZVOUS_WAIT_S
    return RESUME_WINDOW_S if method == "ws_resume" else GATHER_WINDOW_S


Result = tuple[str, Any]
"""("ok", value) | ("error", exception) | ("skip", None): what one worker answers a dispatch."""


@dataclass
class Batch:
    method: str
    args: dict[int, tuple] = field(default_factory=dict)
    closed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    results: list[Result] = field(default_factory=list)
    error: Exception | None = None


class RankBatcher:
    """Gathers per-rank calls into batches; subclasses implement `_rpc` and may react to a
    finished batch in `_after_batch`. The actor must be threaded (max_concurrency > ranks)."""

    _ranks: int

    def _init_batcher(self, ranks: int) -> None:
        self._ranks = ranks
        self._cv = threading.Condition()
        self._open: dict[str, Batch] = {}

    def _complete(self, batch: Batch) -> bool:
        return len(batch.args) >= self._ranks

    def _rpc(self, method: str, per_rank: dict[int, tuple]) -> list[Result]:
        raise NotImplementedError

    def _after_batch(self, batch: Batch) -> None:
        """Called with every batch that dispatched without an engine-level error."""

    def ws_num_ranks(self) -> int:
        return self._ranks

    def ws_rank_call(self, index: int, method: str, args: Sequence[Any]) -> Any:
        """`method(*args)` on local rank `index`, batched with the same method of other ranks."""
        if not 0 <= index < self._ranks:
            raise DestinationError(f"no local rank {index} (this replica has {self._ranks})")
        batch, leader = self._join_batch(index, method, tuple(args))
        if leader:
            self._run_batch(batch)
        batch.done.wait()
        if batch.error is not None:
            raise batch.error
        kind, value = batch.results[index]
        if kind == "error":
            raise value
        if kind == "skip":
            raise DestinationError(f"{method}: rank {index} was not dispatched")
        return value

    def _join_batch(self, index: int, method: str, args: tuple) -> tuple[Batch, bool]:
        with self._cv:
            batch = self._open.get(method)
            if batch is None or batch.closed or index in batch.args:
                batch = self._open[method] = Batch(method)
            batch.args[index] = args
            self._cv.notify_all()
            return batch, len(batch.args) == 1

    def _run_batch(self, batch: Batch) -> None:
        deadline = time.monotonic() + gather_seconds(batch.method)
        with self._cv:
            while not self._complete(batch) and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            batch.closed = True
            if self._open.get(batch.method) is batch:
                del self._open[batch.method]
        try:
            batch.results = self._rpc(batch.method, dict(batch.args))
            self._after_batch(batch)
        except Exception as e:  # the engine died (a worker was killed): every rank learns it
            batch.error = e if isinstance(e, WeightSyncError) else ParticipantDied(f"vLLM engine: {e!r}")
        finally:
            batch.done.set()


def value(result: Result) -> Any:
    kind, v = result
    if kind == "error":
        raise v
    return v


def all_committed(batch: Batch, ranks: int) -> str | None:
    """The one version every local rank answered a full batch with, else None."""
    answers = {r[1] for r in batch.results if r[0] == "ok"}
    if len(batch.args) == ranks and len(answers) == 1 and all(r[0] == "ok" for r in batch.results):
        return str(answers.pop())
    return None
