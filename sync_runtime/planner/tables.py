"""Flat tables of a plan's needs, so a rank's program is cut with array gathers, not objects.

Per need (every needs list of the plan, concatenated): tensor, destination name and box, the
canonical box, bytes, holder set and its cell. Per (cell, holder): where that holder stores the
cell: local name, leading local dims, and the shift from canonical to local coordinates (a
holder's local box is its canonical box shifted, with extra leading dims, see refine.to_local).
Per pattern bucket: the range of its needs in one flat order. Boxes are `width` zero-padded
(lo, hi) pairs. A rank's program (`pack`) is then a handful of numpy gathers over its own rows
(core/plan.py PackedProgram): building Transfer objects and pickling them was 80% of the cost of
cutting every program of a Kimi-K2 plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sync_runtime.core.layouts.base import Box
from sync_runtime.core.plan import PackedProgram, PackedSide
from sync_runtime.planner.needs import Need
from sync_runtime.planner.refine import SourceCell


def _flat(box: Box, width: int) -> list[int]:
    out = [v for pair in box for v in pair]
    return out + [0] * (2 * width - len(out))


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + counts[i]) (vectorised)."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return offsets + np.arange(total, dtype=np.int64)


class NeedTable:
    """The plan's needs as columns (see the module docstring); built once per plan."""

    def __init__(
        self, needs_lists: Sequence[list[Need]], patterns: Sequence[tuple[int, list[int], list[int]]]
    ):
        """`patterns`: per pattern (index of its needs list, need order, bucket bounds)."""
        self.names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self._set_ids: dict[tuple[int, ...], int] = {}
        self._holder_index: dict[int, dict[int, int]] = {}
        self._cells: dict[int, int] = {}
        cells = {id(n.cell): n.cell for needs in needs_lists for n in needs}
        self.width = max(
            max((len(p.local_box) for c in cells.values() for _, p in c.holders), default=1),
            max((len(n.dst_box) for needs in needs_lists for n in needs), default=1),
        )
        self._ch: list[tuple[int, int, list[int], list[int]]] = []
        bases, rows = [], []
        for needs in needs_lists:
            bases.append(len(rows))
            rows.extend(self._need_row(n) for n in needs)
        cols = list(zip(*rows, strict=True)) if rows else [[]] * 7
        self.tensor, self.dst_name, self.dst_nd, self.canon_nd, self.nbytes, self.set, self.cell = (
            np.asarray(c, dtype=np.int64) for c in cols[:7]
        )
        w2 = 2 * self.width
        self.dst_box = np.array([r[7] for r in rows], dtype=np.int32).reshape(-1, w2)
        self.canon = np.array([r[8] for r in rows], dtype=np.int32).reshape(-1, w2)
        ch = self._ch
        self.ch_name = np.array([c[0] for c in ch], dtype=np.int64)
        self.ch_lc = np.array([c[1] for c in ch], dtype=np.int64)
        self.ch_lead = np.array([c[2] for c in ch], dtype=np.int32).reshape(-1, w2)
        self.ch_shift = np.array([c[3] for c in ch], dtype=np.int32).reshape(-1, w2)
        self._patterns(bases, patterns)

    def _patterns(self, bases: list[int], patterns: Sequence[tuple[int, list[int], list[int]]]) -> None:
        order: list[int] = []
        bucket_at: list[int] = []
        pat_base: list[int] = []
        for lst, p_order, bounds in patterns:
            pat_base.append(len(bucket_at))
            start = len(order)
            order.extend(bases[lst] + i for i in p_order)
            bucket_at.extend(start + b for b in bounds[:-1])
        bucket_at.append(len(order))
        self.order = np.asarray(order, dtype=np.int64)
        self.bucket_at = np.asarray(bucket_at, dtype=np.int64)
        self.pat_base = np.asarray(pat_base, dtype=np.int64)

    def _name(self, name: str) -> int:
        found = self._name_ids.get(name)
        if found is None:
            found = self._name_ids[name] = len(self.names)
            self.names.append(name)
        return found

    def _cell(self, cell: SourceCell) -> int:
        """First (cell, holder) row of `cell`; its holders' rows follow in holder order."""
        found = self._cells.get(id(cell))
        if found is None:
            found = self._cells[id(cell)] = len(self._ch)
            w = self.width
            for _, piece in cell.holders:
                local, c = piece.local_box, piece.canon_box
                lead = len(local) - len(c)
                shift = [local[lead + d][0] - c[d][0] for d in range(len(c)) for _ in (0, 1)]
                shift += [0] * (2 * w - len(shift))
                self._ch.append((self._name(piece.local_name), lead, _flat(local[:lead], w), shift))
        return found

    def _need_row(self, n: Need) -> tuple:
        ranks = n.cell.ranks
        sid = self._set_ids.get(ranks)
        if sid is None:
            sid = self._set_ids[ranks] = len(self._set_ids)
            self._holder_index[sid] = {r: h for h, r in enumerate(ranks)}
        w = self.width
        return (self._name(n.tensor), self._name(n.dst_name), len(n.dst_box), len(n.canon_box), n.nbytes,
                sid, self._cell(n.cell), _flat(n.dst_box, w), _flat(n.canon_box, w))  # fmt: skip

    def _holders(self, sets: np.ndarray, senders: np.ndarray) -> np.ndarray:
        """Per transfer, the index of its sender among its need's holders (0 where it is none)."""
        key = sets * (int(senders.max(initial=0)) + 1) + senders
        unique, inverse = np.unique(key, return_inverse=True)
        span = int(senders.max(initial=0)) + 1
        index = self._holder_index
        found = [index[int(u) // span].get(int(u) % span, 0) for u in unique]
        return np.asarray(found, dtype=np.int64)[inverse]

    def side(
        self, rows: Sequence[np.ndarray], pattern: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bucket rows, transfer rows with global name ids, transfer bytes) of one direction.

        `rows`: round, src, dst, k, relayed, nbytes per bucket (in program order); `pattern`
        per bucket.
        """
        rnd, src, dst, k, relayed, nbytes = rows
        gb = self.pat_base[pattern] + k
        lo = self.bucket_at[gb]
        counts = self.bucket_at[gb + 1] - lo
        need = self.order[_expand(lo, counts)]
        t_src, t_rel = np.repeat(src, counts), np.repeat(relayed, counts)
        ch = self.cell[need] + self._holders(self.set[need], t_src)
        lc, canon_nd = self.ch_lc[ch], self.canon_nd[need]
        shifted = self.canon[need] + self.ch_shift[ch]
        box = np.zeros_like(shifted)
        for lead in np.unique(lc).tolist():
            m = lc == lead
            box[m, : 2 * lead] = self.ch_lead[ch[m], : 2 * lead]
            box[m, 2 * lead :] = shifted[m, : shifted.shape[1] - 2 * lead]
        src_name, src_nd, dst_nd = self.ch_name[ch], lc + canon_nd, self.dst_nd[need]
        dst_box, dst_name = self.dst_box[need], self.dst_name[need]
        if t_rel.any():  # a relay copy is read where the forwarder stored it
            src_name, src_nd = np.where(t_rel, dst_name, src_name), np.where(t_rel, dst_nd, src_nd)
            box = np.where(t_rel[:, None], dst_box, box)
        head = np.stack([self.tensor[need], src_name, dst_name, src_nd, dst_nd], axis=1).astype(np.int32)
        transfers = np.concatenate([head, box, dst_box], axis=1)
        buckets = np.stack([rnd, src, dst, nbytes, counts], axis=1).astype(np.int64)
        return buckets, transfers, self.nbytes[need]

    def program(self, n_rounds: int, sends: tuple, recvs: tuple) -> PackedProgram:
        """A rank's packed program from its two `side` results, with a names table of its own."""
        used = np.unique(np.concatenate([sends[1][:, :3].ravel(), recvs[1][:, :3].ravel()]))
        for t in (sends[1], recvs[1]):
            t[:, :3] = np.searchsorted(used, t[:, :3])
        names = tuple(self.names[i] for i in used.tolist())
        return PackedProgram(n_rounds, names, self.width, PackedSide(*sends), PackedSide(*recvs))
