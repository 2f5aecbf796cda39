"""What each destination position needs: its pieces cut by the source cells and by bucket size.

A *position* is a destination rank's coordinate without its replica index; every replica of a
(layout, spec) side at that position holds the same shard, so its needs are computed once and
instantiated per replica. Intersections are cached by box pattern (the source cells' boxes of a
tensor plus the destination piece's box), which many tensors share (every expert of every layer).
`encode_needs` is a needs list's canonical bytes for the plan digest (pairs.py content_hash).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sync_runtime.core.layouts.base import Box, Piece, RankShard, box_numel
from sync_runtime.core.manifest import DTYPE_BYTES, TensorMeta
from sync_runtime.errors import LayoutError
from sync_runtime.planner.refine import SourceCell, intersect, split_rows, to_local


@dataclass(slots=True)
class Need:
    """One contiguous region a destination position needs, readable from any holder of `cell`."""

    tensor: str
    cell: SourceCell
    canon_box: Box
    dst_name: str
    dst_box: Box
    nbytes: int
    sources: list[tuple[int, str, Box] | None] | None = None
    """Per holder of `cell`: (its rank, its local tensor, the region there). Filled on first use;
    None until then (dense needs have hundreds of holders and most needs are never asked)."""

    def source(self, holder: int) -> tuple[int, str, Box]:
        """Where holder `holder` of the cell reads this need from."""
        sources = self.sources
        if sources is None:
            sources = self.sources = [None] * len(self.cell.holders)
        found = sources[holder]
        if found is None:
            rank, piece = self.cell.holders[holder]
            found = (rank, piece.local_name, to_local(self.canon_box, piece.canon_box, piece.local_box))
            sources[holder] = found
        return found


class NeedBuilder:
    """Cuts destination shards into needs against fixed source cells, caching by box pattern."""

    def __init__(self, cells: dict[str, list[SourceCell]], meta: dict[str, TensorMeta], bucket_bytes: int):
        self._cells = cells
        self._meta = meta
        self._bucket_bytes = bucket_bytes
        self._pattern_ids: dict[tuple[Box, ...], int] = {}
        self._tensor_pattern: dict[str, int] = {}
        self._cuts: dict[tuple[int, Box, int], list[tuple[int, Box]]] = {}
        self._placed: dict[tuple[int, Box, int, Box], list[tuple[int, Box, Box, int]]] = {}

    def _pattern(self, tensor: str) -> int:
        pid = self._tensor_pattern.get(tensor)
        if pid is None:
            boxes = tuple(c.box for c in self._cells[tensor])
            pid = self._pattern_ids.setdefault(boxes, len(self._pattern_ids))
            self._tensor_pattern[tensor] = pid
        return pid

    def _cut(self, tensor: str, box: Box, itemsize: int, where: str) -> list[tuple[int, Box]]:
        key = (self._pattern(tensor), box, itemsize)
        cut = self._cuts.get(key)
        if cut is None:
            cut, covered = [], 0
            for index, cell in enumerate(self._cells[tensor]):
                inter = intersect(cell.box, box)
                if inter is not None:
                    covered += box_numel(inter)
                    cut.extend((index, chunk) for chunk in split_rows(inter, itemsize, self._bucket_bytes))
            if covered != box_numel(box):
                raise LayoutError(
                    f"tensor {tensor}: {where} needs region {list(box)} but the source ranks hold only "
                    f"{covered} of its {box_numel(box)} elements"
                )
            self._cuts[key] = cut
        return cut

    def _placed_cut(self, piece: Piece, itemsize: int, where: str) -> list[tuple[int, Box, Box, int]]:
        """`_cut` of the piece with each chunk's local box and bytes: cached by box pattern and
        local box too, which the experts of every layer share (saves a `to_local` per need)."""
        key = (self._pattern(piece.tensor), piece.canon_box, itemsize, piece.local_box)
        placed = self._placed.get(key)
        if placed is None:
            placed = self._placed[key] = [
                (index, sub, to_local(sub, piece.canon_box, piece.local_box), box_numel(sub) * itemsize)
                for index, sub in self._cut(piece.tensor, piece.canon_box, itemsize, where)
            ]
        return placed

    def needs(self, shard: RankShard, where: str) -> list[Need]:
        """The needs of one destination shard, in piece order. `where` names the rank in errors."""
        out: list[Need] = []
        for piece in shard.pieces:
            meta = self._meta.get(piece.tensor)
            if meta is None:
                raise LayoutError(f"{where}: piece of unknown tensor {piece.tensor!r} (not in the manifest)")
            if piece.tensor not in self._cells:
                raise LayoutError(
                    f"tensor {piece.tensor}: {where} needs it but no source rank holds any of it"
                )
            cells = self._cells[piece.tensor]
            for index, sub, dst_box, nbytes in self._placed_cut(piece, DTYPE_BYTES[meta.dtype], where):
                cell = cells[index]
                out.append(
                    Need(
                        tensor=piece.tensor,
                        cell=cell,
                        canon_box=sub,
                        dst_name=piece.local_name,
                        dst_box=dst_box,
                        nbytes=nbytes,
                    )
                )
        return out


def int_section(values: Sequence[int]) -> bytes:
    """`values` as little-endian int64, after their count (a self-delimiting section)."""
    return np.asarray([len(values)], dtype="<i8").tobytes() + np.asarray(values, dtype="<i8").tobytes()


def encode_needs(needs: list[Need]) -> bytes:
    """One needs list for the content hash: per need, indices into tables of its distinct names,
    boxes and holder sets, plus its bytes; then the tables. Every distinct value is encoded once
    (a repr of every need's row, holder set included, cost ~1.5 s at 12,288 ranks)."""
    names: dict[str, int] = {}
    boxes: dict[Box, int] = {}
    holder_sets: dict[tuple[int, ...], int] = {}
    seen: dict[int, int] = {}  # holder sets are shared tuples: hash each object's ranks once
    rows: list[int] = []  # six per need, flat
    for n in needs:
        ranks = n.cell.ranks
        held = seen.get(id(ranks))
        if held is None:  # indices follow values, so sharing between tuples never shows
            held = seen[id(ranks)] = holder_sets.setdefault(ranks, len(holder_sets))
        rows.extend(
            (
                names.setdefault(n.tensor, len(names)),
                boxes.setdefault(n.canon_box, len(boxes)),
                names.setdefault(n.dst_name, len(names)),
                boxes.setdefault(n.dst_box, len(boxes)),
                n.nbytes,
                held,
            )
        )
    text = [name.encode() for name in names]
    return b"".join(
        (
            int_section(rows),
            int_section([len(t) for t in text]),
            b"".join(text),
            int_section([len(b) for b in boxes]),
            int_section([x for b in boxes for r in b for x in r]),
            int_section([len(r) for r in holder_sets]),
            int_section([x for r in holder_sets for x in r]),
        )
    )
