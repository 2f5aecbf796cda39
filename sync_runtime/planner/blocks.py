"""Rows blocks of packed rank programs: built once, shared by every rank whose side uses them.

A side of a rank's program (core/packed.py PackedSide) is its bucket rows, an index per
transfer (per bucket where a bucket's rows are consecutive) and a block of distinct rows. Blocks
repeat across ranks: a sender's is its patterns' rows (it sends each pattern to ~20 replicas at
12,288 ranks: its rows once, not once per bucket), a receiver's is its needs list's rows (every
replica at a destination position receives that list, in other buckets from other senders: one
block per position). Relay copies and cells whose holders store them differently fall back to
one block per distinct bucket. `BlockCache` keeps them per plan, bounded in bytes; `Senders` and
`Side` compute a chunk of ranks' indices (program.py `CompactPrograms._compile` drives them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Protocol

import numpy as np

from sync_runtime.core.packed import PackedRows, PackedSide
from sync_runtime.planner.tables import NeedTable, expand_ranges

BLOCK_CACHE_BYTES = 64 << 20
"""Rows blocks kept per plan for reuse by later ranks (least recently used dropped beyond it)."""


class PlanColumns(Protocol):
    """What the blocks read of a plan's `CompactPrograms` (program.py, which imports this module):
    per bucket its sender, pair, index within the pair's pattern and relay flag; per pair its
    pattern and sender; and the plan's block cache."""

    n_ranks: int
    src: np.ndarray
    pair: np.ndarray
    k: np.ndarray
    relayed: np.ndarray
    pair_pattern: np.ndarray

    @property
    def pair_src(self) -> np.ndarray: ...

    def block(self, key: tuple, build: Callable[[], PackedRows]) -> PackedRows: ...


class BlockCache:
    """Rows blocks by key, least recently used dropped beyond `limit` bytes (thread-safe)."""

    def __init__(self, limit: int):
        self.limit, self.size = limit, 0
        self._blocks: OrderedDict[tuple, PackedRows] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple:
        return (BlockCache, (self.limit,))  # a cache travels empty

    def get_many(
        self, keys: list[tuple], build_many: Callable[[list[int]], list[PackedRows]]
    ) -> list[PackedRows]:
        """The blocks of `keys`; those not cached built in one call, `build_many(positions)` (one
        position per missing key; a block alone costs ~0.2 ms of numpy calls, and 8,128
        senders at 12,288 ranks each use theirs once)."""
        with self._lock:
            seen: set[tuple] = set()
            todo = []
            for i, key in enumerate(keys):
                if key not in self._blocks and key not in seen:
                    seen.add(key)
                    todo.append(i)
        fresh = dict(zip([keys[i] for i in todo], build_many(todo) if todo else [], strict=True))
        return [
            self.get(key, partial(_given, fresh[key]) if key in fresh else partial(_one, build_many, i))
            for i, key in enumerate(keys)
        ]

    def get(self, key: tuple, build: Callable[[], PackedRows]) -> PackedRows:
        with self._lock:
            found = self._blocks.get(key)
            if found is not None:
                self._blocks.move_to_end(key)
                return found
        block = build()
        with self._lock:
            found = self._blocks.get(key)
            if found is not None:  # another thread built it meanwhile: keep one object per key
                return found
            self._blocks[key] = block
            self.size += _block_bytes(block)
            while self.size > self.limit and len(self._blocks) > 1:  # never the block just made
                self.size -= _block_bytes(self._blocks.popitem(last=False)[1])
        return block


def _given(block: PackedRows) -> PackedRows:
    return block


def _one(build_many: Callable[[list[int]], list[PackedRows]], position: int) -> PackedRows:
    """A cached block dropped since `get_many` looked: built again, alone."""
    return build_many([position])[0]


def _block_bytes(block: PackedRows) -> int:
    wire = len(block.wire or b"")
    return (
        block.transfers.nbytes + block.nbytes.nbytes + len(block.joined or "") + 64 * len(block.names) + wire
    )


class Senders:
    """Per source rank, the patterns it sends directly, each stored once in its rows block.

    A pair carries every bucket of its pattern, so a sender's block is its patterns' rows and a
    bucket's transfers are a range of it. Ranks that forward relay copies, or whose pairs are
    only partly sent directly, are left to the per-bucket path (`good` False)."""

    def __init__(self, programs: PlanColumns, table: NeedTable):
        n_ranks, n_pairs = programs.n_ranks, len(programs.pair_pattern)
        pair_src = programs.pair_src
        pair_pattern = programs.pair_pattern
        relayed = programs.relayed
        per_pattern = np.diff(np.append(table.pat_base, len(table.bucket_at) - 1))
        direct = per_pattern[pair_pattern]  # without relay copies, a pair sends all its pattern
        self.good = np.ones(n_ranks + 1, dtype=bool)
        if relayed.any():  # count what each pair sends directly (8.5 M buckets at 12,288 ranks)
            direct = np.bincount(programs.pair[~relayed], minlength=n_pairs)
            self.good[programs.src[relayed]] = False
        partial = (direct > 0) & (direct != per_pattern[pair_pattern])
        self.good[pair_src[partial]] = False
        active = np.flatnonzero((direct > 0) & self.good[pair_src])
        self.span = n_ranks + 1  # unit key: pattern * span + (sender where its rows depend on it)
        src, pattern = pair_src[active], pair_pattern[active]
        tag = np.where(table.pattern_mixed[pattern], src, n_ranks)
        per_src = len(table.pat_base) * self.span
        units, inverse = np.unique(src * per_src + pattern * self.span + tag, return_inverse=True)
        self.of_pair = np.zeros(n_pairs, dtype=np.int64)
        self.of_pair[active] = inverse.reshape(-1)
        owner = units // per_src
        self.units = units - owner * per_src
        self.at = np.searchsorted(owner, np.arange(n_ranks + 2))
        self.rows = np.diff(table.pattern_at)[self.units // self.span]
        ends = np.concatenate([[0], np.cumsum(self.rows)])
        self.start = ends[:-1] - ends[self.at[owner]]
        """Per unit: its first row in its sender's block."""

    def key(self, rank: int) -> tuple:
        return ("patterns", self.units[self.at[rank] : self.at[rank + 1]].tobytes())

    def build_many(self, table: NeedTable, ranks: list[int]) -> list[PackedRows]:
        """The blocks of `ranks` in one batch of gathers."""
        lo = self.at[np.asarray(ranks, dtype=np.int64)]
        n_units = self.at[np.asarray(ranks, dtype=np.int64) + 1] - lo
        pick = expand_ranges(lo, n_units)
        units, rows = self.units[pick], self.rows[pick]
        need = np.take(table.order, expand_ranges(table.pattern_at[units // self.span], rows))
        tag = units % self.span
        sender = np.repeat(np.where(tag < self.span - 1, tag, -1), rows)
        bounds = np.concatenate([[0], np.cumsum(rows)])[np.concatenate([[0], np.cumsum(n_units)])]
        return table.blocks(need, bounds, None, sender)


class Side:
    """One direction of a chunk of ranks: bucket rows, and each rank's rows block and indices."""

    def __init__(
        self,
        programs: PlanColumns,
        table: NeedTable,
        buckets: np.ndarray,
        b_at: np.ndarray,
        t_at: np.ndarray,
        pair: np.ndarray,
        pattern: np.ndarray,
        relayed: np.ndarray,
        gb: np.ndarray,
        lo: np.ndarray,
    ):
        """`buckets`: the chunk's bucket rows (core/packed.py PackedSide), rank after rank, from
        `b_at`; their transfers from `t_at`. Per row: its pair, the pair's pattern, whether it is
        a relay copy, the bucket of the pattern (`gb`, global) and that bucket's first entry of
        `table.order` (`lo`)."""
        self.programs, self.table, self.buckets, self.b_at, self.t_at = programs, table, buckets, b_at, t_at
        self.pair, self.pattern, self.relayed, self.gb, self.lo = pair, pattern, relayed, gb, lo
        self.b_list = self.b_at.tolist()
        self.t_list = self.t_at.tolist()
        self._first_list: list[int] = []
        self._empty: PackedSide | None = None

    def by_sender(
        self, senders: Senders, ranks: np.ndarray, inside: np.ndarray
    ) -> tuple[np.ndarray, list[bool]]:
        """Per bucket of the chunk, its first row in its sender's pattern block (where `good`):
        a bucket's rows are consecutive there (core/packed.py PackedSide `runs`)."""
        whole = (inside & senders.good[ranks]).tolist()
        if not any(whole) or not len(senders.start):  # no good rank of the chunk sends
            return np.zeros(len(self.buckets), dtype=np.int32), whole
        start = np.take(senders.start, np.take(senders.of_pair, self.pair), mode="clip")
        start += self.lo - np.take(self.table.pattern_at, self.pattern)
        return start.astype(np.int32), whole

    def by_list(self) -> tuple[np.ndarray, list[bool]]:
        """Indices of the chunk's transfers into their needs lists, and per rank whether it
        receives exactly its whole needs list directly (then one block per list serves it)."""
        t = self.table
        if len(self.pattern) == 0:
            return np.zeros(0, dtype=np.int32), [False] * (len(self.b_at) - 1)
        lists = np.take(t.pattern_list, self.pattern)
        n = np.diff(self.b_at)
        first = lists[np.minimum(self.b_at[:-1], len(lists) - 1)]
        odd = self.relayed | np.take(t.pattern_mixed, self.pattern) | (lists != np.repeat(first, n))
        odd_at = np.concatenate([[0], np.cumsum(odd)])[self.b_at]
        whole = (n > 0) & (np.diff(odd_at) == 0) & (np.diff(self.t_at) == t.list_len[first])
        self._first_list = first.tolist()
        return np.take(t.order_local, expand_ranges(self.lo, self.buckets[:, 4])), whole.tolist()

    def list_of(self, i: int) -> int:
        return self._first_list[i]

    def packed(self, i: int, index: np.ndarray, block: PackedRows | None, runs: bool = False) -> PackedSide:
        """Rank `i` of the chunk: its bucket rows and `block`, its rows block, with `index`, the
        chunk's rows in it, per bucket (`runs`) or per transfer; without `block`, a block of its
        own buckets."""
        b0, b1, t0, t1 = self.b_list[i], self.b_list[i + 1], self.t_list[i], self.t_list[i + 1]
        buckets = self.buckets[b0:b1]
        if b0 == b1:  # nothing this way (half of all sides): one empty side for the chunk
            if self._empty is None:
                build = partial(self.table.rows, np.zeros(0, dtype=np.int64))
                empty = np.zeros(0, dtype=np.int32)
                self._empty = PackedSide(buckets, empty, self.programs.block(("empty",), build))
            return self._empty
        if block is not None:
            return PackedSide(buckets, index[b0:b1] if runs else index[t0:t1], block, runs)
        # Per bucket: one unit per distinct (pattern bucket, relayed, sender where rows depend on it).
        span = self.programs.n_ranks + 1
        gb, relayed = self.gb[b0:b1], self.relayed[b0:b1]
        depends = np.take(self.table.pattern_mixed, self.pattern[b0:b1]) & ~relayed
        tag = np.where(depends, buckets[:, 1], span - 1)
        units, inverse = np.unique((gb * 2 + relayed) * span + tag, return_inverse=True)
        t = self.table
        ub, tag = units // span, units % span
        lo = np.take(t.bucket_at, ub >> 1)
        rows = np.take(t.bucket_at, (ub >> 1) + 1) - lo
        starts = np.concatenate([[0], np.cumsum(rows)])[:-1]

        def build_units() -> PackedRows:
            need = np.take(t.order, expand_ranges(lo, rows))
            sender = np.repeat(np.where(tag < span - 1, tag, -1), rows)
            return t.rows(need, np.repeat((ub & 1).astype(bool), rows), sender)

        block = self.programs.block(("buckets", units.tobytes()), build_units)
        return PackedSide(buckets, np.take(starts, inverse.reshape(-1)).astype(np.int32), block, True)
