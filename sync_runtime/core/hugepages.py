"""Planning without numpy's transparent-huge-page advice.

numpy advises the kernel to back every large array with 2 MB pages (`madvise(MADV_HUGEPAGE)`).
With the common THP setting `defrag=madvise`, each first touch of such a page may compact memory
synchronously. The planner allocates and frees dozens of arrays of tens of MB (one per bucket
column at 8.5 M buckets), each fresh memory: measured on the 12,288-rank benchmark, the advice
cost ~0.6 s of system time of ~1.7 s (`NUMPY_MADVISE_HUGEPAGE=0` A/B, three runs each). The
advice is switched off around the planner's passes and the caller's setting restored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

try:  # numpy >= 2
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy 1.26
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:  # no such switch in this numpy: leave allocations as they are
        _set_madvise_hugepage = None


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
