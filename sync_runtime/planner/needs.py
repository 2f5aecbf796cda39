"""What each destination position needs: its pieces cut by the source cells and by bucket size.

A *position* is a destination rank's coordinate without its replica index; every replica of a
(layout, spec) side at that position holds the same shard, so its needs are computed once and
instantiated per replica. Intersections are cached by box pattern (the source cells' boxes of a
tensor plus the destination piece's box), which many tensors share (every expert of every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

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
