"""A rank's program as arrays (`PackedProgram`): what the coordinator sends each rank.

Per side (sends, receives) its bucket rows and its transfers as indices into a block of distinct
transfer rows (`PackedRows`) with the block's own names table; blocks are shared by the ranks
that use the same rows (planner/blocks.py). core/plan.py `RankPlan` unpacks them into buckets
and transfers on the rank that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from sync_runtime.core.block_wire import deflate, flat, inflate, unflat

NAME_SEP = "\0"
"""Joins a packed program's names when it is pickled (never part of a tensor name in practice)."""
BOX_FIELDS = 5
"""Leading int columns of a packed transfer row: tensor, src_name, dst_name, src ndim, dst ndim."""


@dataclass(frozen=True, slots=True)
class PackedRows:
    """Distinct transfer rows and the names they use: one side's block (see `PackedSide`).

    `transfers` rows (int32): tensor, src_name, dst_name (indices into `names`), the two boxes'
    ndims, then the src box and the dst box, each `width` (lo, hi) pairs, zero-padded. `nbytes`:
    per row. Blocks are shared: one object serves every rank whose side uses the same rows (the
    planner caches them), so names are per block, not per program.
    """

    transfers: np.ndarray
    nbytes: np.ndarray
    names: tuple[str, ...]
    joined: str | None = field(default=None, compare=False, repr=False)
    """`names` joined with NAME_SEP, where the maker checked that no name holds it (computed
    once per shared block, not once per pickled program)."""
    wire: bytes | None = field(default=None, compare=False, repr=False)
    """The block compressed (`compressed`), for blocks shared by many ranks: compressed once,
    it is what each of their programs carries. Derived from the fields above: a changed copy
    (`dataclasses.replace`) must drop it."""

    def __reduce__(self) -> tuple:
        if self.wire is not None:
            return (_inflate_rows, (self.wire,))
        # The names as one string: a tuple of thousands of names was ~70% of pickling a program.
        joined = _joined(self)
        if joined is None:
            return (PackedRows, (self.transfers, self.nbytes, self.names))
        return (_flat_rows, (flat(self.transfers), flat(self.nbytes), len(self.names), joined))


def _joined(block: PackedRows) -> str | None:
    """`block.names` joined with NAME_SEP; None where a name holds NAME_SEP."""
    if block.joined is not None:
        return block.joined
    joined = NAME_SEP.join(block.names)
    return joined if joined.count(NAME_SEP) == max(len(block.names) - 1, 0) else None


def _flat_rows(transfers: tuple, nbytes: tuple, n_names: int, joined: str) -> PackedRows:
    return _joined_rows(unflat(*transfers), unflat(*nbytes), n_names, joined)


def _joined_rows(transfers: np.ndarray, nbytes: np.ndarray, n_names: int, joined: str) -> PackedRows:
    names = tuple(joined.split(NAME_SEP)) if n_names else ()
    return PackedRows(transfers, nbytes, names, joined)


def compressed(block: PackedRows) -> PackedRows:
    """`block` carrying its compressed form (core/block_wire.py). A receiver's block is shared
    by every replica at its position (256 at 12,288 ranks) and compresses ~10x (names and boxes
    repeat): compressed once, each of their programs is pickled and sent ~10x smaller. Blocks
    whose names hold NAME_SEP stay as they are."""
    joined = _joined(block)
    if joined is None:
        return block
    return replace(
        block, joined=joined, wire=deflate(block.transfers, block.nbytes, len(block.names), joined)
    )


def _inflate_rows(wire: bytes) -> PackedRows:
    rows, nbytes, n_names, joined = inflate(wire)
    block = _joined_rows(rows, nbytes, n_names, joined)
    if len(block.names) != n_names:
        raise ValueError(f"compressed rows block: {len(block.names)} names, its header says {n_names}")
    return replace(block, wire=wire)


@dataclass(frozen=True, slots=True)
class PackedSide:
    """One direction of a rank's program as arrays (what travels to the rank, see `RankPlan`).

    `buckets` rows: round, src, dst, nbytes, transfer count (int32 where every bucket of the
    plan fits it, else int64). `index` (int32): per transfer, in bucket order, its row of
    `rows`; or, where `runs`, per bucket its first row, the bucket's transfers being that row
    and the next ones (a sender's block holds each bucket's rows in order: 32 M transfers at
    12,288 ranks become 8.5 M starts). Rows are stored once per distinct row, not once per
    transfer: a sender sends the same bucket to every replica of a destination position (~20x
    at 12,288 ranks), and the replicas at one position receive the same needs (in other
    buckets, from other senders), so they share one `rows` block.
    """

    buckets: np.ndarray
    index: np.ndarray
    rows: PackedRows
    runs: bool = False

    def __reduce__(self) -> tuple:
        # Arrays as bytes (block_wire.py), positional args: a slots dataclass otherwise pickles
        # through Python-level state hooks.
        return (_flat_side, (flat(self.buckets), flat(self.index), self.rows, self.runs))

    def transfer_rows(self) -> list[int]:
        """Per transfer, in bucket order, its row of `rows` (`runs` expanded)."""
        index = self.index.tolist()
        if not self.runs:
            return index
        counts = self.buckets[:, 4].tolist()
        return [row for first, n in zip(index, counts, strict=True) for row in range(first, first + n)]


def _flat_side(buckets: tuple, index: tuple, rows: PackedRows, runs: bool) -> PackedSide:
    return PackedSide(unflat(*buckets), unflat(*index), rows, runs)


@dataclass(frozen=True, slots=True)
class PackedProgram:
    """A rank's program as arrays and names tables: ~10x cheaper to cut and pickle than objects."""

    n_rounds: int
    width: int
    sends: PackedSide
    recvs: PackedSide

    def __reduce__(self) -> tuple:
        return (PackedProgram, (self.n_rounds, self.width, self.sends, self.recvs))
