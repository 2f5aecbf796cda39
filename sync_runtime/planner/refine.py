"""Box geometry: intersections, the common refinement of source copies, and row splitting.

Boxes follow `layouts.base`: tuples of half-open (start, stop) ranges, one per dim. A local box is
its canonical box with extra leading dims of extent 1, so a canonical sub-box maps to the local
tensor by shifting its trailing dims (`to_local`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from sync_runtime.core.layouts.base import Box, Piece, box_numel


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same rank, or None when empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def to_local(sub: Box, canon: Box, local: Box) -> Box:
    """Where canonical sub-box `sub` of a piece (`canon` -> `local`) sits in the local tensor."""
    lead = len(local) - len(canon)
    if sub == canon:
        return local
    return local[:lead] + tuple(
        (l0 + s0 - c0, l0 + s1 - c0)
        for (s0, s1), (c0, _), (l0, _) in zip(sub, canon, local[lead:], strict=True)
    )


def split_rows(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Split `box` into contiguous row ranges of at most `max_bytes` each.

    Splits along the first dim with extent > 1; when even a single row of that dim is too large,
    each row is split along the next dim (recursively), so every piece stays a box.
    """
    nbytes = box_numel(box) * itemsize
    if nbytes <= max_bytes:
        return [box]
    dim = next(d for d, (lo, hi) in enumerate(box) if hi - lo > 1)
    lo, hi = box[dim]
    row_bytes = nbytes // (hi - lo)
    if row_bytes <= max_bytes:
        step = max_bytes // row_bytes
        return [(*box[:dim], (s, min(s + step, hi)), *box[dim + 1 :]) for s in range(lo, hi, step)]
    out: list[Box] = []
    for s in range(lo, hi):
        out.extend(split_rows((*box[:dim], (s, s + 1), *box[dim + 1 :]), itemsize, max_bytes))
    return out


@dataclass(slots=True)
class SourceCell:
    """A canonical region all of whose `holders` store identical bytes: alternative senders."""

    box: Box
    holders: list[tuple[int, Piece]]
    """(global source rank, the piece that stores this region on it), in rank order."""
    ranks: tuple[int, ...] = field(default=())
    """The holders' ranks (filled by `build_cells`; read in the planner's hot loops)."""
    piece: Piece | None = None
    """The one piece object every holder reads, where `build_cells` knows it (DP copies share
    one cached shard); None: see `holders`."""


def _overlap_free(boxes: Sequence[Box]) -> bool:
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0])
    for n, i in enumerate(order):
        stop0 = boxes[i][0][1]
        for j in order[n + 1 :]:
            if boxes[j][0][0] >= stop0:
                break  # sorted by first-dim start: nothing further can overlap box i
            if intersect(boxes[i], boxes[j]) is not None:
                return False
    return True


def refine(cells: list[SourceCell]) -> list[SourceCell]:
    """Make the cells of one tensor pairwise disjoint (the common refinement of their boxes).

    Identical boxes were merged already; partially overlapping ones (not produced by the
    shipped layouts, but legal) are cut along every box edge into grid cells, each held by
    every piece that contains it.
    """
    if len(cells) < 2 or _overlap_free([c.box for c in cells]):
        return cells
    ndim = len(cells[0].box)
    edges = [sorted({e for c in cells for e in c.box[d]}) for d in range(ndim)]
    grid: list[Box] = [()]
    for d in range(ndim):
        grid = [(*g, (a, b)) for g in grid for a, b in zip(edges[d], edges[d][1:], strict=False)]
    out: list[SourceCell] = []
    for g in grid:
        holders = [h for c in cells if intersect(c.box, g) == g for h in c.holders]
        if holders:
            out.append(SourceCell(g, sorted(holders, key=lambda h: h[0])))
    return out


def build_cells(pieces: Iterable[tuple[int, Piece]]) -> dict[str, list[SourceCell]]:
    """Per canonical tensor, its disjoint source cells with their alternative holders."""
    return build_shared_cells(((rank,), (piece,)) for rank, piece in pieces)


def build_shared_cells(
    groups: Iterable[tuple[Sequence[int], Sequence[Piece]]],
) -> dict[str, list[SourceCell]]:
    """`build_cells` over (ranks, pieces) groups: ranks (ascending) that all hold `pieces`, the
    groups in order of their first rank (then cells come in the same order as rank by rank).

    DP copies share one cached shard, so grouping them visits each piece once per group, not
    once per rank (~1 M pieces on 8,192 source ranks, ~120 k distinct). Holders end in rank
    order, as `build_cells` over ranks in order would leave them (stable: a rank's pieces keep
    their order)."""
    by_tensor: dict[str, dict[Box, SourceCell]] = {}
    out_of_order: dict[int, SourceCell] = {}
    for group, pieces in groups:
        ranks = tuple(group)
        for piece in pieces:
            cells = by_tensor.get(piece.tensor)
            if cells is None:
                cells = by_tensor[piece.tensor] = {}
            holders = [(rank, piece) for rank in ranks]
            cell = cells.get(piece.canon_box)
            if cell is None:
                # One group's cell: its ranks are the group's tuple, shared (most cells: experts).
                cells[piece.canon_box] = SourceCell(piece.canon_box, holders, ranks, piece)
                continue
            if cell.holders[-1][0] > ranks[0]:
                out_of_order[id(cell)] = cell
            cell.holders.extend(holders)
            cell.ranks = ()  # several groups: from the merged holders, below
            if cell.piece is not piece:  # groups whose shards share the piece keep it
                cell.piece = None
    for cell in out_of_order.values():
        cell.holders.sort(key=itemgetter(0))
    out = {name: refine(list(cells.values())) for name, cells in by_tensor.items()}
    # Equal holder sets as one tuple object: the planner keys dicts by them (tuples do not cache
    # their hash, but equal keys that are one object compare at once) and hashes each object once.
    shared: dict[tuple[int, ...], tuple[int, ...]] = {}
    for cells in out.values():
        for cell in cells:
            if not cell.ranks:  # merged or refined cells (a cell has at least one holder)
                ranks = tuple([rank for rank, _ in cell.holders])
                cell.ranks = shared.setdefault(ranks, ranks)
    return out
