"""Where one process spends a sync: wall and thread-CPU seconds per named phase.

A process-wide tally, read and reset with `take()` (the vllm-server bench collects it from the
coordinator, the source actors, the runtime's proxy and each vLLM worker after every sync).
Each `span` costs two clock reads and a lock; the hot path opens one per bucket, not per
element. Wall minus CPU seconds of a span is time its thread waited: for the wire, a lock, or
a core taken by another process (a vLLM engine serving on the same cores). Torch's intra-op
threads are not counted in the CPU figure of the thread that launched the op.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(slots=True)
class Tally:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    calls: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "calls": self.calls}


_tallies: dict[str, Tally] = {}
_lock = threading.Lock()


def add(name: str, wall_s: float, cpu_s: float = 0.0) -> None:
    with _lock:
        t = _tallies.setdefault(name, Tally())
        t.wall_s += wall_s
        t.cpu_s += cpu_s
        t.calls += 1


@contextmanager
def span(name: str) -> Iterator[None]:
    """Account the enclosed block's wall and thread-CPU seconds to `name` (also when it raises)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        add(name, time.perf_counter() - wall, time.thread_time() - cpu)


def take() -> dict[str, dict[str, float]]:
    """Every tally since the last `take()`, by name, then reset."""
    with _lock:
        out = {name: t.as_dict() for name, t in sorted(_tallies.items())}
        _tallies.clear()
    return out


def take_from(_actor: object) -> dict[str, dict[str, float]]:
    """`take()` inside a Ray actor's process: `handle.__ray_call__.remote(take_from)`."""
    return take()
