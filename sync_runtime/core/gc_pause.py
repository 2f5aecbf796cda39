"""Pausing Python's cyclic garbage collector around object-heavy passes.

Shard builds, planning and the need table allocate millions of small acyclic objects (pieces,
needs, tuples, ints); the collector would rescan the growing heap again and again (measured:
~40% of plan time on Kimi-K2, twice the time of a Kimi-K2 shard build). Nothing there forms
cycles that need it, so it is paused and the caller's setting restored.

On the way out, what the pass left is kept out of the young generations, which every collection
scans (0.42 s for the first collection right after planning 12,288 ranks, and again as it ages):

- In a process whose heap nobody froze, every tracked object is moved to the oldest generation
  (`gc.freeze` then `gc.unfreeze`: list splices, nothing scanned). The cost: garbage cycles made
  before the pause wait for a full collection instead of a young one.
- In a process whose heap was frozen before the pass, the heap stays frozen and the pass's
  survivors join it (a young collection first, then `gc.freeze`: what vLLM's `freeze_gc_heap`
  does once an engine has started). A process freezes its heap so that no full collection
  rescans its long-lived objects (a trainer after building its model; the test session's site
  module after each heavy import), and Python has no partial unfreeze: the splice above would
  hand the whole heap back to the collector at the first pass. The young collection frees the
  garbage cycles made meanwhile (by other threads too) before freezing; a survivor that later
  becomes part of a garbage cycle stays in memory until the process unfreezes.

The passes run where shards and plans are built: the runtime (coordinator) and the source ranks
(the trainer's processes). A vLLM destination rank builds neither (it receives its program and
reports its tensors from the live model), so vLLM's frozen engine processes never run one.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

FROZEN_BY_HOST = 10_000
"""Frozen objects above which the heap counts as frozen on purpose: CPython 3.12 starts with a few
hundred of its own (375 here), a frozen vLLM process holds millions."""

_seen_frozen = False


def _host_froze() -> bool:
    """Whether this process's heap was frozen on purpose. `gc.get_freeze_count()` walks the whole
    frozen list (31% of a test module's CPU when asked at every pass of a frozen process), so it is
    asked only until the answer is yes: from then on this module keeps the heap frozen itself.
    (Should the host unfreeze it later, the next pass freezes it again, as the host had it.)"""
    global _seen_frozen
    if not _seen_frozen:
        _seen_frozen = gc.get_freeze_count() > FROZEN_BY_HOST  # cheap while few are frozen
    return _seen_frozen


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    host_froze = _host_froze()
    gc.disable()
    try:
        yield
    finally:
        if host_froze:
            gc.collect(1)  # generations 0 and 1: the pass's survivors and whatever else is young
            gc.freeze()
        else:
            gc.freeze()  # survivors to the oldest generation (see the module docstring)
            gc.unfreeze()
        if was_enabled:
            gc.enable()
