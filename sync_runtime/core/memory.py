"""Memory settings for the planner: its large short-lived arrays without fresh pages each time.

At 12,288 ranks the planner allocates and frees dozens of arrays of 34-68 MB (one per bucket
column), and on the VMs we measure on, faulting in fresh pages costs about as much as the
arithmetic that fills them. Two defaults make every such array fresh memory:

- numpy advises transparent huge pages for large arrays (`madvise(MADV_HUGEPAGE)`); with the
  common THP setting `defrag=madvise` a first touch may compact memory synchronously.
  `hugepages_unadvised` turns the advice off around a pass and restores the caller's setting
  (A/B, 12,288 ranks, three runs each: ~0.6 s less system time).
- glibc serves blocks above its mmap threshold (32 MiB at most) with their own mmap and unmaps
  them on free, so the next array of that size faults in every page again.
  `keep_large_blocks_on_heap` (glibc only, once per process) serves them from the heap and keeps
  what is freed there for reuse (A/B with the equivalent environment variables, two runs each:
  planning's system time 1.46 -> 0.55 s, 512 k -> 192 k page faults; set here, 0.51 s). The process then
  keeps its peak heap instead of returning it between passes: planner processes (the runtime
  pod's coordinator, the CLI) hold their plans anyway. glibc's adaptive mmap threshold is off
  from then on; nothing is restored.
"""

from __future__ import annotations

import ctypes
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager

try:  # numpy >= 2
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy 1.26
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:  # no such switch in this numpy: leave allocations as they are
        _set_madvise_hugepage = None

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""glibc mallopt parameters (malloc.h)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory glibc keeps at the top of its heap before returning the excess to the system."""
_heap_lock = threading.Lock()
_heap_kept: bool | None = None
"""Whether `keep_large_blocks_on_heap` applied (None: not asked yet)."""


@contextmanager
def hugepages_unadvised() -> Iterator[None]:
    if _set_madvise_hugepage is None:
        yield
        return
    was = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(was)


def keep_large_blocks_on_heap() -> bool:
    """Large blocks from glibc's heap, freed memory kept for reuse (see the module docstring);
    once per process. Whether it applies (False elsewhere than glibc)."""
    global _heap_kept
    with _heap_lock:
        if _heap_kept is None:
            _heap_kept = False
            if platform.libc_ver()[0] == "glibc":
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
                # trim threshold first: a refused one leaves the mmap setting untouched
                _heap_kept = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and mallopt(M_MMAP_MAX, 0))
        return _heap_kept
