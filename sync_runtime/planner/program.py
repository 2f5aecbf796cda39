"""Compact plan storage: a plan's buckets as arrays over the pairs of pairs.py.

A scheduled bucket is a `BucketRef` (pair, bucket index within its pattern); after scheduling the
refs become flat arrays with per-rank CSR indices, so `rank_buckets` touches only that rank's
rows and builds `Transfer` objects for them alone. Packed programs (`rank_plans`) are cut for a
batch of ranks at once: bucket rows and row indices gathered from the CSR indices in one pass,
then per rank a side is its bucket rows, the rows of its transfers (per bucket for a sender) and
a block of distinct rows (core/packed.py PackedSide), shared with the ranks that use the same
rows (blocks.py). One rank (`rank_plan`) is a batch of one, so both give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

import numpy as np

from sync_runtime.core.gc_pause import gc_paused
from sync_runtime.core.memory import hugepages_unadvised, keep_large_blocks_on_heap
from sync_runtime.core.packed import PackedProgram, PackedRows, compressed
from sync_runtime.core.plan import Bucket, RankPlan, Round
from sync_runtime.planner.blocks import BLOCK_CACHE_BYTES, BlockCache, Senders, Side
from sync_runtime.planner.columns import grouped, narrow
from sync_runtime.planner.pairs import BucketRef, PairBook
from sync_runtime.planner.tables import NeedTable, expand_ranges

PerRound = tuple[tuple[Bucket, ...], ...]
CHUNK_TRANSFERS = 1 << 17
"""Transfer rows per batch of `CompactPrograms.rank_plans` (~100 B of arrays each while cut:
a batch's arrays stay a few MB, and each batch reuses the memory of the one before)."""


class CompactPrograms:
    """A plan's buckets as arrays (round, src, dst, pair, k, relayed) with per-rank indices."""

    def __init__(self, book: PairBook, n_rounds: int, columns: Sequence[np.ndarray]):
        """`columns`: round, src, dst, pair, k, relayed per bucket, in round order. Index columns
        are kept 32-bit where they fit (columns.py), so are the per-rank CSR orders."""
        self.book = book
        self.n_rounds = n_rounds
        n_buckets = len(columns[0])
        self.round, self.src, self.dst, self.pair, self.k = (
            narrow(c, max(n_rounds, n_buckets, len(book.pair_src))) for c in columns[:5]
        )
        self.relayed = np.asarray(columns[5], dtype=bool)
        n_ranks = int(max(self.src.max(initial=-1), self.dst.max(initial=-1))) + 1
        # Rows are in round order; a stable sort keeps each rank's buckets in that order.
        self._by_src, self._src_at = grouped(self.src, n_ranks)
        self._by_dst, self._dst_at = grouped(self.dst, n_ranks)
        self.n_ranks = n_ranks
        self.pair_pattern = np.asarray(book.pair_pattern, dtype=np.int64)
        self._pair_src: np.ndarray | None = None
        self._nbytes, self._count = self._bucket_tables()
        self._row_dtype = np.result_type(self.round, self.src, self.dst, self._nbytes, self._count)
        """Of packed programs' bucket rows (int32 where every bucket of the plan fits)."""
        self._any_relayed = bool(self.relayed.any())
        self._table: NeedTable | None = None
        self._per_rank: list[int] | None = None
        self._sender_units: Senders | None = None
        self._blocks = BlockCache(BLOCK_CACHE_BYTES)

    @property
    def pair_src(self) -> np.ndarray:
        """Per pair, its sender (for the blocks of sender programs, blocks.py; made once)."""
        if self._pair_src is None:
            self._pair_src = np.asarray(self.book.pair_src, dtype=np.int64)
        return self._pair_src

    @classmethod
    def from_refs(cls, book: PairBook, rounds: Sequence[Sequence[BucketRef]]) -> CompactPrograms:
        rows = [(i, b.src_rank, b.dst_rank, b.pair, b.k, b.relayed) for i, r in enumerate(rounds) for b in r]
        arr = np.array(rows, dtype=np.int64).reshape(-1, 6)
        return cls(book, len(rounds), [arr[:, c].copy() for c in range(6)])

    def bucket_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row: bytes and transfer count (computed once, with the programs; shared, not copied)."""
        return self._nbytes, self._count

    def _bucket_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """`bucket_tables` from the patterns, vectorised (32-bit where the values fit)."""
        patterns = self.book.patterns
        first = np.concatenate([[0], np.cumsum([len(p.sizes) for p in patterns])]).astype(np.int64)
        sizes = narrow([n for p in patterns for n in p.sizes])
        counts = narrow(np.concatenate([np.diff(p.bounds) for p in patterns]) if patterns else [])
        self._gb_sizes = sizes  # per bucket of a pattern (patterns' buckets concatenated)
        flat = narrow(first, int(first[-1]))[self.pair_pattern]
        flat = flat[self.pair]
        flat += self.k
        return sizes[flat], counts[flat]

    def _per_round(self, rows: np.ndarray) -> PerRound:
        out: list[list[Bucket]] = [[] for _ in range(self.n_rounds)]
        columns = (self.round, self.src, self.dst, self.pair, self.k, self.relayed, self._nbytes)
        transfers = self.book.transfers
        # One gather per column, then plain ints: numpy scalar indexing per row was most of the cost.
        for rnd, src, dst, pair, k, relayed, nbytes in zip(*(c[rows].tolist() for c in columns), strict=True):
            out[rnd].append(Bucket(src, dst, transfers(pair, k, src, dst, relayed), nbytes))
        return tuple(tuple(r) for r in out)

    def rank_buckets(self, rank: int) -> tuple[PerRound, PerRound]:
        if rank >= self.n_ranks:
            empty = tuple(() for _ in range(self.n_rounds))
            return empty, empty
        sends = self._by_src[self._src_at[rank] : self._src_at[rank + 1]]
        recvs = self._by_dst[self._dst_at[rank] : self._dst_at[rank + 1]]
        return self._per_round(sends), self._per_round(recvs)

    def table(self) -> NeedTable:
        """The plan's need table (built on first use: only programs need it)."""
        if self._table is None:
            with gc_paused(), hugepages_unadvised():  # one row of ints and tuples per need and cell
                self._table = self.book.table()
        return self._table

    def rank_plan(self, rank: int, digest: str) -> RankPlan:
        """`rank`'s packed program: gathers over its own rows (see tables.py), no objects."""
        return next(self._compile([rank], digest))  # a batch of one: as `rank_plans` cuts it

    def rank_plans(
        self, ranks: Iterable[int], digest: str, chunk_transfers: int = CHUNK_TRANSFERS
    ) -> Iterator[RankPlan]:
        """The programs of `ranks`, in that order, each equal to `rank_plan`'s: cut in chunks of
        about `chunk_transfers` transfer rows, each one batch of gathers (per-call overhead is
        paid per chunk, not per rank) and bounded memory."""
        keep_large_blocks_on_heap()  # each chunk's arrays reuse the last one's memory (core/memory.py)
        per_rank = self._rank_transfers()
        chunk: list[int] = []
        size = 0
        for rank in ranks:
            chunk.append(rank)
            size += per_rank[rank] if 0 <= rank < self.n_ranks else 0
            if size >= chunk_transfers:
                yield from self._compile(chunk, digest)
                chunk, size = [], 0
        if chunk:
            yield from self._compile(chunk, digest)

    def _rank_transfers(self) -> list[int]:
        """Per rank: transfer rows of its program (sends and receives)."""
        if self._per_rank is None:
            n = self.n_ranks
            if self.relayed.any():  # relay copies are not their pair's: count bucket by bucket
                weights = self._count.astype(np.float64)  # bincount sums floats: exact below 2**53
                sent = np.bincount(self.src, weights=weights, minlength=n)
                received = np.bincount(self.dst, weights=weights, minlength=n)
            else:  # every pair moves all of its pattern: ~10x fewer pairs than buckets
                per_pattern = np.array([len(p.order) for p in self.book.patterns], dtype=np.float64)
                weights = per_pattern[self.pair_pattern]
                sent = np.bincount(self.pair_src, weights=weights, minlength=n)
                pair_dst = np.asarray(self.book.pair_dst, dtype=np.int64)
                received = np.bincount(pair_dst, weights=weights, minlength=n)
            self._per_rank = (sent + received).astype(np.int64).tolist()
        return self._per_rank

    def _compile(self, chunk: list[int], digest: str) -> Iterator[RankPlan]:
        """Programs of `chunk`: bucket rows and per-transfer indices gathered for the whole chunk,
        then per rank its two sides' blocks of rows, from the block cache where an earlier rank
        used the same rows."""
        table = self.table()
        senders = self._senders()
        with hugepages_unadvised():  # the chunk's arrays (core/memory.py); not around the yields
            sends, recvs, ranks, inside = self._sides(chunk, table)
            send_index, send_senders = sends.by_sender(senders, ranks, inside)
            recv_index, recv_lists = recvs.by_list()
            # Whole senders' blocks: from the cache, those not in it built in one batch
            whole = [i for i, ok in enumerate(send_senders) if ok]
            blocks = self._blocks.get_many(
                [senders.key(int(ranks[i])) for i in whole],
                lambda picks: senders.build_many(table, [int(ranks[whole[j]]) for j in picks]),
            )
        sent = dict(zip(whole, blocks, strict=True))
        for i, rank in enumerate(chunk):
            s = sends.packed(i, send_index, sent.get(i), runs=True)
            listed = None  # a receiver of its whole needs list: the block of that list
            if recv_lists[i]:
                lst = recvs.list_of(i)
                listed = self.block(("list", lst), partial(self._list_rows, lst))
            r_side = recvs.packed(i, recv_index, listed)
            yield RankPlan(rank, digest, packed=PackedProgram(self.n_rounds, table.width, s, r_side))

    def _sides(self, chunk: list[int], table: NeedTable) -> tuple[Side, Side, np.ndarray, np.ndarray]:
        """The chunk's sends and receives, for all its ranks at once: only round, peer, pair and
        k are gathered from the plan's bucket columns (8.5 M rows at 12,288 ranks, a cache miss
        a row); bytes, transfer count and first need come from per-pattern-bucket tables."""
        ranks = np.asarray(chunk, dtype=np.int64)
        inside = (ranks >= 0) & (ranks < self.n_ranks)
        ranks = np.where(inside, ranks, 0)
        sides = []
        run = bool(inside.all()) and bool((np.diff(ranks) == 1).all())  # consecutive: a slice each
        for order, at, own, peer in (
            (self._by_src, self._src_at, 1, self.dst),
            (self._by_dst, self._dst_at, 2, self.src),
        ):
            counts = np.where(inside, at[ranks + 1] - at[ranks], 0)
            if run:
                rows = order[at[ranks[0]] : at[ranks[-1] + 1]]
            else:
                rows = np.take(order, expand_ranges(at[ranks], counts))
            pair, k = np.take(self.pair, rows), np.take(self.k, rows)
            relayed = np.take(self.relayed, rows) if self._any_relayed else np.zeros(len(rows), dtype=bool)
            pattern = np.take(self.pair_pattern, pair)
            gb = np.take(table.pat_base, pattern) + k  # the bucket of its pattern
            lo = np.take(table.bucket_at, gb)
            buckets = np.empty((len(rows), 5), dtype=self._row_dtype)
            buckets[:, 0] = np.take(self.round, rows)
            buckets[:, own] = np.repeat(ranks, counts)
            buckets[:, 3 - own] = np.take(peer, rows)
            buckets[:, 3] = np.take(self._gb_sizes, gb)
            buckets[:, 4] = np.take(table.bucket_at, gb + 1) - lo
            b_at = np.concatenate([[0], np.cumsum(counts)])
            t_at = np.concatenate([[0], np.cumsum(buckets[:, 4])])[b_at]
            sides.append(Side(self, table, buckets, b_at, t_at, pair, pattern, relayed, gb, lo))
        return sides[0], sides[1], ranks, inside

    def _list_rows(self, lst: int) -> PackedRows:
        """Every need of needs list `lst`, in list order, received directly (one block serves
        every replica at that destination position: compressed once, core/packed.py)."""
        t = self.table()
        base = int(t.list_base[lst])
        return compressed(t.rows(np.arange(base, base + int(t.list_len[lst]), dtype=np.int64)))

    def _senders(self) -> Senders:
        if self._sender_units is None:
            self._sender_units = Senders(self, self.table())
        return self._sender_units

    def block(self, key: tuple, build: Callable[[], PackedRows]) -> PackedRows:
        """The rows block of `key` (cached: ranks whose sides use the same rows share one)."""
        return self._blocks.get(key, build)

    def bucket_rows(self) -> np.ndarray:
        sizes, _ = self.bucket_tables()
        return np.stack([self.round, self.src, self.dst, sizes], axis=1)

    def all_rounds(self) -> tuple[Round, ...]:
        return tuple(Round(r) for r in self._per_round(np.arange(len(self.round))))
