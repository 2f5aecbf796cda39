"""Integer columns as narrow as their values allow.

A plan of 12,288 ranks has 8.5 M buckets; each int64 column of them is 68 MB of fresh memory, and
on the VMs we run on a page fault costs about as much as the arithmetic that fills the page. Rank,
pair, bucket and round indices fit 32 bits in any realistic plan, so they are stored in 32 bits
when they fit; code that multiplies them (the cost model's slot indices) widens slices first.
"""

from __future__ import annotations

import numpy as np


def index_dtype(largest: int) -> type[np.signedinteger]:
    """int32 when every value up to `largest` fits, else int64."""
    return np.int32 if largest < 1 << 31 else np.int64


def narrow(values: np.ndarray | list[int], largest: int | None = None) -> np.ndarray:
    """`values` as `index_dtype` of their maximum (or of `largest`); no copy when already so."""
    arr = np.asarray(values)
    if largest is None:
        largest = int(arr.max(initial=0)) if arr.size else 0
        largest = max(largest, -int(arr.min(initial=0)) if arr.size else 0)
    return arr.astype(index_dtype(largest), copy=False)


GROUP_SLICE = 1 << 20
"""Rows `grouped` orders at once where keys need more than 16 bits: its sort temporaries stay
~10 MB and are reused slice to slice (one argsort of 8.5 M rows returns a 68 MB int64 order, all
of it fresh memory)."""


def grouped(keys: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """A stable counting sort: the row indices of `keys` (values in [0, n_keys)) grouped by key,
    rows of one key in their original order, and where each key's group starts (plus the end).

    The same order as `np.argsort(keys, kind="stable")`, in `index_dtype`. Keys wider than 16
    bits are ordered a slice of rows at a time: each slice's rows go after the earlier slices'
    rows of the same key."""
    counts = np.bincount(keys, minlength=n_keys)
    at = np.concatenate([[0], np.cumsum(counts)])
    dtype = index_dtype(len(keys))
    if n_keys <= 1 << 15:  # 16-bit keys: numpy's stable argsort is a radix sort, one pass over
        # all rows beats the slices (0.24 against 0.34 s at 8.5 M rows, 12,288 keys)
        return np.argsort(keys.astype(np.int16), kind="stable").astype(dtype), at
    order = np.empty(len(keys), dtype=dtype)
    cursor = at[:-1].copy()  # next free slot of each key
    narrow_keys = keys.dtype if n_keys <= np.iinfo(keys.dtype).max else np.int64
    for first in range(0, len(keys), GROUP_SLICE):
        part = keys[first : first + GROUP_SLICE]
        local = np.argsort(part.astype(narrow_keys), kind="stable")
        sorted_keys = part[local]
        per_key = np.bincount(part, minlength=n_keys)
        # rank of each sorted row within its key: its index minus where its key starts in the slice
        starts = np.cumsum(per_key) - per_key
        slot = cursor[sorted_keys] + (np.arange(len(part)) - starts[sorted_keys])
        order[slot] = local + first
        cursor += per_key
    return order, at
