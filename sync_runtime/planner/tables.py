"""Flat tables of a plan's needs, so rank programs are cut with array gathers, not objects.

Per need (every needs list of the plan, concatenated): a packed transfer row as far as the need
decides it (tensor, destination name, ndims, canonical box, destination box), its bytes, holder
set and the first (cell, holder) row of its cell. Per (cell, holder): which stored *piece* the
holder reads it from. Per distinct piece (DP copies share one: a few hundred for Kimi-K2 against a
million holder entries): the row that turns a need's canonical box into the holder's local box
(local name, leading local dims, and the shift from canonical to local coordinates, see
refine.to_local), in the same packed columns, so a transfer row is one need row plus one piece
row. Per pattern bucket: the range of its needs in one flat order (`order`, with each need's
index within its needs list in `order_local`). Boxes are `width` zero-padded (lo, hi) pairs
(core/packed.py PackedRows). `rows` builds a block of transfer rows with its own names table;
blocks are shared by ranks (program.py), so names are renumbered once per block, not per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from itertools import chain
from operator import is_, itemgetter

import numpy as np

from sync_runtime.core.layouts.base import Box, Piece
from sync_runtime.core.packed import BOX_FIELDS, NAME_SEP, PackedRows
from sync_runtime.planner.columns import index_dtype
from sync_runtime.planner.needs import Need
from sync_runtime.planner.refine import SourceCell

DENSE_HOLDERS_LIMIT = 1 << 26
"""Largest (holder set x rank) table looked up densely (int16: 128 MiB); beyond it, sorted keys."""
RENUMBER_TABLE_LIMIT = 1 << 24
"""Largest (block x name) table that renumbers a batch of blocks' names by a gather (int32:
64 MiB; ~3x faster than a binary search of every name); beyond it, a binary search."""


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + counts[i]) (vectorised)."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return offsets + np.arange(total, dtype=np.int64)


class HolderIndex:
    """Where a rank sits in a holder set (0 where it is none: a relay forwarder, whose row is
    rewritten anyway). Dense (set, rank) table when small enough, else sorted keys."""

    def __init__(self, sets: Sequence[tuple[int, ...]], dense_limit: int = DENSE_HOLDERS_LIMIT):
        lens = np.fromiter(map(len, sets), dtype=np.int64, count=len(sets))
        ranks = np.fromiter(chain.from_iterable(sets), dtype=np.int64, count=int(lens.sum()))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        position = np.arange(len(ranks), dtype=np.int64) - np.repeat(starts, lens)
        self.span = int(ranks.max(initial=0)) + 2  # the last column: "no holder" for every set
        keys = np.repeat(np.arange(len(sets), dtype=np.int64), lens) * self.span + ranks
        small = np.min_scalar_type(int(lens.max(initial=0)))
        self.dense: np.ndarray | None = None
        if len(sets) * self.span <= dense_limit:
            self.dense = np.zeros(len(sets) * self.span, dtype=small)
            self.dense[keys] = position
        else:
            order = np.argsort(keys)
            self.keys, self.position = keys[order], position[order]

    def lookup(self, sets: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        query = sets * self.span + np.minimum(ranks, self.span - 1)
        if self.dense is not None:
            return self.dense[query]
        at = np.minimum(np.searchsorted(self.keys, query), len(self.keys) - 1)  # keys: not empty here
        return np.where(self.keys[at] == query, self.position[at], 0)


class NeedTable:
    """The plan's needs as columns (see the module docstring); built once per plan."""

    def __init__(
        self, needs_lists: Sequence[list[Need]], patterns: Sequence[tuple[int, list[int], list[int]]]
    ):
        """`patterns`: per pattern (index of its needs list, need order, bucket bounds)."""
        self.names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self._boxes: dict[Box, int] = {}
        self._set_ids: dict[tuple[int, ...], int] = {}
        self._piece_ids: dict[int, int] = {}  # id(piece) -> row (pieces live in the cells)
        self._piece_values: dict[tuple[str, Box, Box], int] = {}
        self._piece_parts: list[tuple[int, int, list[int]]] = []  # name, lead, unpadded box part
        self._ch: list[int] = []
        bases, ints = self._needs(needs_lists)
        local = max((len(v[1]) for v in self._piece_values), default=1)
        self.width = max(local, max(map(len, self._boxes), default=1))
        self._columns(np.array(ints, dtype=np.int64).reshape(-1, 10))
        self._patterns(bases, patterns)
        self._name_objects = np.array(self.names, dtype=object)
        self._plain_names = not any(NAME_SEP in name for name in self.names)

    def _needs(self, needs_lists: Sequence[list[Need]]) -> tuple[list[int], list[int]]:
        """One pass over the needs: 10 ints each (see `_columns`); cells filed at first sight.
        Names are numbered in the order the per-need tables always did (tensor, destination,
        then the cell's holders)."""
        names, boxes = self._name_ids, self._boxes  # inlined lookups: this loop is the build
        cells: dict[int, tuple[int, int, bool]] = {}  # id(cell) -> `_cell`
        bases: list[int] = []
        ints: list[int] = []
        count = 0
        for needs in needs_lists:
            bases.append(count)
            count += len(needs)
            for n in needs:
                tensor, dst = names.get(n.tensor), names.get(n.dst_name)
                if tensor is None or dst is None:
                    tensor, dst = self._name(n.tensor), self._name(n.dst_name)
                cell = cells.get(id(n.cell))
                if cell is None:
                    cell = cells[id(n.cell)] = self._cell(n.cell)
                canon_box, dst_box = n.canon_box, n.dst_box
                canon_at, dst_at = boxes.get(canon_box), boxes.get(dst_box)
                if canon_at is None or dst_at is None:
                    canon_at, dst_at = self._box(canon_box), self._box(dst_box)
                ints += (tensor, dst, len(canon_box), len(dst_box), canon_at, dst_at,
                         cell[0], cell[1], n.nbytes, cell[2])  # fmt: skip
        return bases, ints

    def _columns(self, ints: np.ndarray) -> None:
        """Per need: packed row (tensor, -, dst name, canon ndim, dst ndim, canon box, dst box),
        cell, holder set, bytes, and the full transfer row where every holder of its cell reads
        the same piece (DP copies: all cells of the shipped layouts); per piece its packed row;
        the holder index (for the other cells)."""
        w2 = 2 * self.width
        boxes = np.zeros((len(self._boxes), w2), dtype=np.int32)
        for box, i in self._boxes.items():
            flat = [v for pair in box for v in pair]
            boxes[i, : len(flat)] = flat
        rows = np.zeros((len(ints), BOX_FIELDS + 2 * w2), dtype=np.int32)
        rows[:, [0, 2, 3, 4]] = ints[:, :4]
        rows[:, BOX_FIELDS : BOX_FIELDS + w2] = boxes[ints[:, 4]]
        rows[:, BOX_FIELDS + w2 :] = boxes[ints[:, 5]]
        self.need_rows = rows
        self.cell, self.set, self.nbytes = ints[:, 6].copy(), ints[:, 7].copy(), ints[:, 8].copy()
        self.mixed = ints[:, 9].astype(bool)
        self._any_mixed = bool(self.mixed.any())
        self.piece_rows = np.zeros((len(self._piece_parts), BOX_FIELDS + 2 * w2), dtype=np.int32)
        for i, (name, lead, part) in enumerate(self._piece_parts):
            self.piece_rows[i, [1, 3]] = name, lead
            self.piece_rows[i, BOX_FIELDS : BOX_FIELDS + len(part)] = part
        self.piece_lead = self.piece_rows[:, 3].copy()
        self._leads = sorted(set(self.piece_lead.tolist()) - {0})
        self.ch_piece = np.array(self._ch, dtype=np.int64)
        self.holders = HolderIndex(list(self._set_ids))
        self.full_rows = self._read_rows(np.arange(len(rows)), self.ch_piece[self.cell])

    def _box(self, box: Box) -> int:
        """Index of `box` in the table of distinct boxes (boxes repeat across tensors)."""
        found = self._boxes.get(box)
        if found is None:
            found = self._boxes[box] = len(self._boxes)
        return found

    def _cell(self, cell: SourceCell) -> tuple[int, int, bool]:
        """(first row of `cell` in `ch_piece`, its holder set, whether its holders read different
        pieces). A mixed cell's holders' rows follow in order (looked up by holder position); a
        cell whose holders all read one piece has that one row."""
        first = len(self._ch)
        sid = self._set_ids.setdefault(cell.ranks, len(self._set_ids))
        known = self._piece_ids
        # DP copies share one piece object (one cached shard): one row for all holders instead
        # of a lookup and a row each (~1 M holder entries at 12,288 ranks). Cells that know
        # their piece say so (refine.SourceCell); others are tested holder by holder, in C.
        shared = cell.piece
        if shared is None and all(map(partial(is_, cell.holders[0][1]), map(itemgetter(1), cell.holders))):
            shared = cell.holders[0][1]
        if shared is not None:
            row = known.get(id(shared))
            if row is None:
                row = known[id(shared)] = self._piece(shared)
            self._ch.append(row)
            return first, sid, False
        rows = []
        for _, piece in cell.holders:
            row = known.get(id(piece))
            if row is None:
                row = known[id(piece)] = self._piece(piece)
            rows.append(row)
        mixed = rows.count(rows[0]) != len(rows)
        self._ch += rows if mixed else rows[:1]
        return first, sid, mixed

    def _piece(self, piece: Piece) -> int:
        """Row of a distinct stored region: name, leading dims, canonical-to-local shift."""
        local, canon = piece.local_box, piece.canon_box
        value = (piece.local_name, local, canon)
        row = self._piece_values.get(value)
        if row is None:
            row = self._piece_values[value] = len(self._piece_values)
            lead = len(local) - len(canon)
            shift = [local[lead + d][0] - canon[d][0] for d in range(len(canon)) for _ in (0, 1)]
            part = [v for pair in local[:lead] for v in pair] + shift
            self._piece_parts.append((self._name(piece.local_name), lead, part))
        return row

    def _patterns(self, bases: list[int], patterns: Sequence[tuple[int, list[int], list[int]]]) -> None:
        order: list[int] = []
        bucket_at: list[int] = []
        pat_base: list[int] = []
        for lst, p_order, bounds in patterns:
            pat_base.append(len(bucket_at))
            start = len(order)
            base = bases[lst]
            order.extend([base + i for i in p_order])
            bucket_at.extend([start + b for b in bounds[:-1]])
        bucket_at.append(len(order))
        self.order = np.asarray(order, dtype=np.int64)
        self.bucket_at = np.asarray(bucket_at, dtype=np.int64)
        self.pat_base = np.asarray(pat_base, dtype=np.int64)
        pat_base.append(len(bucket_at) - 1)
        self.pattern_at = self.bucket_at[pat_base]
        """Pattern p's needs: `order[pattern_at[p]:pattern_at[p + 1]]` (all its buckets)."""
        mixed = np.concatenate([[0], np.cumsum(self.mixed[self.order])])
        self.pattern_mixed = np.diff(mixed[self.pattern_at]) > 0
        """Whether a pattern's rows depend on which holder sends it."""
        self.list_base = np.asarray(bases, dtype=np.int64)
        self.list_len = np.diff(np.append(self.list_base, len(self.cell)))
        self.pattern_list = np.asarray([lst for lst, _, _ in patterns], dtype=np.int64)
        lists = np.repeat(self.pattern_list, np.diff(self.pattern_at))
        self.order_local = (self.order - self.list_base[lists]).astype(np.int32)
        """Per entry of `order`: the need's index within its needs list."""

    def _name(self, name: str) -> int:
        found = self._name_ids.get(name)
        if found is None:
            found = self._name_ids[name] = len(self.names)
            self.names.append(name)
        return found

    def rows(
        self, need: np.ndarray, relayed: np.ndarray | None = None, sender: np.ndarray | None = None
    ) -> PackedRows:
        """A block of transfer rows, one per entry of `need` (need ids), with its own names table.

        `relayed` (per row, optional): a relay copy's row (read where the forwarder stored it).
        `sender` (per row, optional): the sending rank, for rows of mixed cells (the holder's
        own piece); -1 or absent: no mixed cell among the rows, or relayed.
        """
        return self.blocks(need, np.array([0, len(need)]), relayed, sender)[0]

    def blocks(
        self,
        need: np.ndarray,
        bounds: np.ndarray,
        relayed: np.ndarray | None = None,
        sender: np.ndarray | None = None,
    ) -> list[PackedRows]:
        """`rows` of several blocks in one batch of gathers: block b is rows bounds[b] to
        bounds[b + 1]. Each block gets the names table `rows` would give it alone."""
        transfers = np.take(self.full_rows, need, axis=0)  # np.take: ~5x faster than [need] here
        if self._any_mixed and sender is not None:  # cells whose holders store them differently
            m = np.flatnonzero(self.mixed[need] & (sender >= 0))
            if len(m):
                holder = self.holders.lookup(self.set[need[m]], sender[m])
                transfers[m] = self._read_rows(need[m], self.ch_piece[self.cell[need[m]] + holder])
        if relayed is not None and relayed.any():
            self._relay(transfers, relayed)
        # Renumber the name columns into each block's own names (in global id order), once per
        # block (blocks are shared by ranks, so this is not paid per rank): ids offset by the
        # block, sorted once, are every block's used names one block after the other.
        n_blocks, n_names = len(bounds) - 1, len(self.names)
        wide = index_dtype((n_blocks + 1) * n_names)  # 32-bit keys where they fit: faster sorts
        block = np.repeat(np.arange(n_blocks, dtype=wide) * n_names, np.diff(bounds))
        keys = transfers[:, :3] + block[:, None]
        used = np.sort(keys, axis=None)  # np.unique's Python-level overhead was most of this
        used = used[np.concatenate([[True], used[1:] != used[:-1]])] if len(used) else used
        first = np.searchsorted(used, np.arange(n_blocks + 1, dtype=wide) * n_names)
        if n_blocks * n_names <= RENUMBER_TABLE_LIMIT:  # key -> its index in `used`, by a gather
            renumber = np.empty(n_blocks * n_names, dtype=np.int32)
            renumber[used] = np.arange(len(used), dtype=np.int32)
            index = np.take(renumber, keys)
        else:
            index = np.searchsorted(used, keys)
        transfers[:, :3] = index - np.repeat(first[:-1], np.diff(bounds))[:, None]
        names = self._name_objects[used % max(n_names, 1)].tolist()
        nbytes = np.take(self.nbytes, need)
        out = []
        for b in range(n_blocks):
            block_names = tuple(names[first[b] : first[b + 1]])
            joined = NAME_SEP.join(block_names) if self._plain_names else None
            t0, t1 = bounds[b], bounds[b + 1]
            out.append(PackedRows(transfers[t0:t1], nbytes[t0:t1], block_names, joined))
        return out

    def _read_rows(self, need: np.ndarray, piece: np.ndarray) -> np.ndarray:
        """Transfer rows of `need` read from `piece`: the need's row plus the piece's (its name,
        leading dims, and the shift that makes the canonical box local)."""
        rows = np.take(self.need_rows, need, axis=0)
        rows += np.take(self.piece_rows, piece, axis=0)
        if not self._leads:
            return rows
        w2, b = 2 * self.width, BOX_FIELDS
        lead = self.piece_lead[piece]
        for n_lead in self._leads:  # leading local dims: the canonical box moves right
            m = np.flatnonzero(lead == n_lead)
            boxes = np.take(self.piece_rows[:, b : b + w2], piece[m], axis=0)
            boxes[:, 2 * n_lead :] += np.take(self.need_rows[:, b : b + w2 - 2 * n_lead], need[m], axis=0)
            rows[m, b : b + w2] = boxes
        return rows

    def _relay(self, transfers: np.ndarray, relayed: np.ndarray) -> None:
        """A relay copy is read where the forwarder stored it: source = destination columns."""
        w2, b = 2 * self.width, BOX_FIELDS
        m = np.flatnonzero(relayed)
        rows = transfers[m]
        rows[:, 1], rows[:, 3] = rows[:, 2], rows[:, 4]
        rows[:, b : b + w2] = rows[:, b + w2 :]
        transfers[m] = rows
