"""Run functions on a pool of local rank processes that share one TCPStore (tests, bench, demo).

The pool is spawned once and reused: starting a process that imports torch costs seconds, a
sync on loopback milliseconds. `run(fn, args)` calls `fn(ctx, *args[i])` on ranks
0..len(args)-1 and collects what each returns (picklable, small). A rank process that dies
(`os._exit` in a fault test) is reported with its exit code; `revive()` then replaces it, and
the ranks that survived keep running.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
READY = 0
"""Call id of a rank's "started" message (real calls count from 1)."""
STARTUP_TIMEOUT_S = 300.0
"""A rank process imports torch before it answers: tens of seconds on a loaded 2-core machine."""
CLOSE_GRACE_S = 2.0
"""How long `close` waits for the ranks to leave on their own before it kills them."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank function gets: its rank and where the coordinator's store listens."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    group_name: str
    """Unique per `run` call, so every call can connect its own SyncGroup."""


@dataclass(slots=True)
class Outcome:
    rank: int
    value: Any = None
    error: str | None = None
    """Traceback of an exception the function raised (not a transfer failure: those are values)."""
    exitcode: int | None = None
    """Set when the rank process died during the call."""


def _serve(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    # Ranks share this machine's cores: torch's default (all cores per process) oversubscribes
    # them, and spinning intra-op threads made packing 10x slower with 4 ranks on 2 cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    outbox.put((READY, rank, None, None))  # imports done: a call's timeout counts its work only
    while True:
        job = inbox.get()
        if job is None:
            return
        call_id, fn, args = job
        ctx = RankContext(rank, world, HOST, port, f"run{call_id}")
        try:
            outbox.put((call_id, rank, fn(ctx, *args), None))
        except Exception:
            outbox.put((call_id, rank, None, traceback.format_exc()))


class LocalWorld:
    """A pool of `size` spawned rank processes and the TCPStore a coordinator would host."""

    def __init__(self, size: int) -> None:
        # The master store lives in this (coordinator) process, as in production.
        self.store = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(size)]
        self.size = size
        self._procs = [self._spawn(ctx, r) for r in range(size)]
        self._starting = set(range(size))
        self._calls = 0

    def _spawn(self, ctx: Any, rank: int) -> Any:
        proc = ctx.Process(
            target=_serve,
            args=(rank, self.size, self.store.port, self._inboxes[rank], self._outbox),
            daemon=True,
        )
        proc.start()
        return proc

    def revive(self) -> int:
        """Start a fresh process (with a fresh inbox) for every dead rank; returns how many. A rank
        dies inside its function, after the run before it was answered, so it holds no lock of
        the shared outbox; answers of the run it died in carry an old call id and are dropped."""
        ctx = mp.get_context("spawn")
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        for rank in dead:
            self._procs[rank].join(1)
            self._inboxes[rank] = ctx.Queue()
            self._procs[rank] = self._spawn(ctx, rank)
            self._starting.add(rank)
        return len(dead)

    def _await_ready(self) -> None:
        """Until every started rank process said it is up (its imports take seconds), so that
        `run`'s timeout does not count process start-up."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self._starting:
            try:
                call_id, rank, _, _ = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = sorted(r for r in self._starting if not self._procs[r].is_alive())
                if dead:
                    raise RuntimeError(f"rank process(es) {dead} exited while starting") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank process(es) {sorted(self._starting)} not up in {STARTUP_TIMEOUT_S:g}s"
                    ) from None
                continue
            if call_id == READY:
                self._starting.discard(rank)

    def run(self, fn: Callable[..., Any], args: Sequence[tuple], timeout_s: float = 120.0) -> list[Outcome]:
        """Call `fn(ctx, *args[r])` on ranks 0..len(args)-1 concurrently; one Outcome per rank."""
        if len(args) > self.size:
            raise ValueError(f"{len(args)} ranks asked, the pool has {self.size}")
        self._await_ready()
        self._calls += 1
        call_id = self._calls
        for rank, rank_args in enumerate(args):
            self._inboxes[rank].put((call_id, fn, tuple(rank_args)))
        outcomes: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < len(args) and time.monotonic() < deadline:
            try:
                got_id, rank, value, error = self._outbox.get(timeout=0.2)
            except queue.Empty:
                for rank in range(len(args)):
                    proc = self._procs[rank]
                    if rank not in outcomes and not proc.is_alive():
                        outcomes[rank] = Outcome(rank, exitcode=proc.exitcode)
                continue
            if got_id == call_id:
                outcomes[rank] = Outcome(rank, value=value, error=error)
        for rank in range(len(args)):
            outcomes.setdefault(rank, Outcome(rank, error=f"no answer within {timeout_s}s"))
        return [outcomes[r] for r in range(len(args))]

    def alive(self) -> bool:
        """Every rank process still runs (`revive()` replaces the dead ones)."""
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for inbox, proc in zip(self._inboxes, self._procs, strict=True):
            if proc.is_alive():
                inbox.put(None)
        # One grace period for the whole pool, not per rank: a rank still inside a fault test's
        # call (or slow to tear its process groups down) is our own child and holds nothing we need.
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
