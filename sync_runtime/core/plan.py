"""The plan: the planner's output and the transfer engine's input (design §5).

Ranks are global ranks of the sync's single process group: source ranks first (in the order of
`SyncPlan.ranks`), then destination ranks. Within a round every rank sends and receives each of
its buckets once; rounds run in order. A bucket is one flat message between one (src, dst) pair.

A planned `SyncPlan` is backed by compact `RankPrograms` (the planner's per-pair patterns, pairs.py, and
per-bucket arrays, see planner/program.py): `for_rank` cuts one rank's program from indices built
once, `rank_plans` many ranks' in batched passes, and `rounds` (every bucket as objects) is only
materialised when someone asks for it. A cut program is packed (`PackedProgram`): per side its
bucket rows, and its transfers as indices into a block of distinct rows that ranks share.
A hand-made plan (tests) gives `rounds` directly; its per-rank index is built on first use.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sync_runtime.core.layouts.base import Box
from sync_runtime.core.packed import BOX_FIELDS, PackedProgram, PackedSide
from sync_runtime.core.topology import RankCoord


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy `src_name[src_box]` on `src_rank` to `dst_name[dst_box]` on `dst_rank` (same element count)."""

    src_rank: int
    dst_rank: int
    tensor: str
    """Canonical tensor the bytes belong to."""
    src_name: str
    src_box: Box
    dst_name: str
    dst_box: Box
    nbytes: int

    def __reduce__(self) -> tuple:
        # Positional args: ~2x smaller and faster to pickle than the dataclass's per-field state
        # dict, and every rank's program is pickled to it (most of a program is its transfers).
        return (Transfer, (self.src_rank, self.dst_rank, self.tensor, self.src_name, self.src_box,
                           self.dst_name, self.dst_box, self.nbytes))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Bucket:
    """Transfers between one pair packed into one flat message, in this order."""

    src_rank: int
    dst_rank: int
    transfers: tuple[Transfer, ...]
    nbytes: int

    def __reduce__(self) -> tuple:
        return (Bucket, (self.src_rank, self.dst_rank, self.transfers, self.nbytes))


@dataclass(frozen=True, slots=True)
class Round:
    buckets: tuple[Bucket, ...]


PerRound = tuple[tuple[Bucket, ...], ...]


def _box(flat: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(flat[::2], flat[1::2], strict=True))


def unpack_side(side: PackedSide, width: int, n_rounds: int) -> PerRound:
    """`side`'s buckets and transfers as objects, per round (built on the rank that runs them)."""
    out: list[list[Bucket]] = [[] for _ in range(n_rounds)]
    names, w = side.rows.names, BOX_FIELDS + 2 * width
    parts = []  # per distinct row: the transfer's fields but its ranks (built once per row)
    for row, n in zip(side.rows.transfers.tolist(), side.rows.nbytes.tolist(), strict=True):
        sb, db = _box(row[BOX_FIELDS : BOX_FIELDS + 2 * row[3]]), _box(row[w : w + 2 * row[4]])
        parts.append((names[row[0]], names[row[1]], sb, names[row[2]], db, n))
    index = side.transfer_rows()
    at = 0
    for rnd, src, dst, nbytes, count in side.buckets.tolist():
        ts = tuple(Transfer(src, dst, *parts[i]) for i in index[at : at + count])
        at += count
        out[rnd].append(Bucket(src, dst, ts, nbytes))
    return tuple(tuple(r) for r in out)


class RankPlan:
    """What one rank does: per round, the buckets it sends and the buckets it receives.

    Built either from bucket tuples or from a `PackedProgram`; a packed plan pickles as its
    arrays and builds its `Bucket`/`Transfer` objects on first access, on the rank that runs it.
    """

    __slots__ = ("_packed", "_recvs", "_sends", "digest", "rank")

    def __init__(
        self,
        rank: int,
        digest: str,
        sends: PerRound | None = None,
        recvs: PerRound | None = None,
        *,
        packed: PackedProgram | None = None,
    ):
        if (sends is None or recvs is None) == (packed is None):
            raise ValueError("RankPlan needs sends and recvs, or a packed program")
        self.rank, self.digest = rank, digest
        self._sends, self._recvs, self._packed = sends, recvs, packed

    def _unpack(self) -> None:
        p = self._packed
        assert p is not None
        self._sends = unpack_side(p.sends, p.width, p.n_rounds)
        self._recvs = unpack_side(p.recvs, p.width, p.n_rounds)

    @property
    def sends(self) -> PerRound:
        if self._sends is None:
            self._unpack()
        assert self._sends is not None
        return self._sends

    @property
    def recvs(self) -> PerRound:
        if self._recvs is None:
            self._unpack()
        assert self._recvs is not None
        return self._recvs

    def __reduce__(self) -> tuple:
        if self._packed is not None:
            return (_packed_plan, (self.rank, self.digest, self._packed))
        return (RankPlan, (self.rank, self.digest, self._sends, self._recvs))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankPlan):
            return NotImplemented
        mine, theirs = (self.rank, self.digest), (other.rank, other.digest)
        return mine == theirs and self.sends == other.sends and self.recvs == other.recvs

    def __hash__(self) -> int:
        return hash((self.rank, self.digest))

    def __repr__(self) -> str:
        return f"RankPlan(rank={self.rank}, digest={self.digest[:16]!r})"


def _packed_plan(rank: int, digest: str, packed: PackedProgram) -> RankPlan:
    return RankPlan(rank, digest, packed=packed)


class RankPrograms(Protocol):
    """Compact storage of a plan's buckets that can cut one rank's program without a full scan."""

    n_rounds: int

    def rank_buckets(
        self, rank: int
    ) -> tuple[tuple[tuple[Bucket, ...], ...], tuple[tuple[Bucket, ...], ...]]:
        """(sends, recvs) of `rank`, per round."""
        ...

    def all_rounds(self) -> tuple[Round, ...]:
        """Every bucket, as objects (large plans: costly; for tools and small plans)."""
        ...

    def rank_plan(self, rank: int, digest: str) -> RankPlan:
        """`rank`'s program (compact storages answer with a packed one)."""
        ...

    def rank_plans(self, ranks: Iterable[int], digest: str) -> Iterator[RankPlan]:
        """The programs of `ranks` in that order, each equal to `rank_plan`'s (compact storages
        cut them in batches: much cheaper per rank than one call each)."""
        ...

    def bucket_rows(self) -> np.ndarray:
        """Per bucket: round, src, dst, bytes (int64, shape (n, 4)), without building objects."""
        ...


class _RoundIndex:
    """`RankPrograms` over explicit rounds: one pass files every bucket under its two ranks."""

    def __init__(self, rounds: tuple[Round, ...]):
        self.n_rounds = len(rounds)
        self._rounds = rounds
        self._sends: dict[int, list[tuple[int, Bucket]]] = {}
        self._recvs: dict[int, list[tuple[int, Bucket]]] = {}
        for i, rnd in enumerate(rounds):
            for b in rnd.buckets:
                self._sends.setdefault(b.src_rank, []).append((i, b))
                self._recvs.setdefault(b.dst_rank, []).append((i, b))

    def _per_round(self, filed: list[tuple[int, Bucket]]) -> tuple[tuple[Bucket, ...], ...]:
        out: list[list[Bucket]] = [[] for _ in range(self.n_rounds)]
        for i, b in filed:
            out[i].append(b)
        return tuple(tuple(r) for r in out)

    def rank_buckets(
        self, rank: int
    ) -> tuple[tuple[tuple[Bucket, ...], ...], tuple[tuple[Bucket, ...], ...]]:
        return self._per_round(self._sends.get(rank, [])), self._per_round(self._recvs.get(rank, []))

    def all_rounds(self) -> tuple[Round, ...]:
        return self._rounds

    def rank_plan(self, rank: int, digest: str) -> RankPlan:
        return RankPlan(rank, digest, *self.rank_buckets(rank))

    def rank_plans(self, ranks: Iterable[int], digest: str) -> Iterator[RankPlan]:
        return (self.rank_plan(rank, digest) for rank in ranks)

    def bucket_rows(self) -> np.ndarray:
        rows = [(i, b.src_rank, b.dst_rank, b.nbytes) for i, r in enumerate(self._rounds) for b in r.buckets]
        return np.array(rows, dtype=np.int64).reshape(-1, 4)


class SyncPlan:
    """Every rank's transfers, grouped into rounds and buckets, with the plan's digest."""

    __slots__ = ("_programs", "_rounds", "digest", "ranks", "relay", "stats")

    def __init__(
        self,
        ranks: tuple[RankCoord, ...],
        rounds: tuple[Round, ...] | None = None,
        digest: str = "",
        relay: bool = False,
        stats: dict | None = None,
        *,
        programs: RankPrograms | None = None,
    ):
        if (rounds is None) == (programs is None):
            raise ValueError("SyncPlan needs exactly one of rounds and programs")
        self.ranks = ranks
        """Coordinate of every global rank of the sync process group (sources first)."""
        self.digest = digest
        """Stable hash of everything that defines the plan; every participant checks it."""
        self.relay = relay
        """True when destination replicas forward to each other (some buckets then leave a destination)."""
        self.stats: dict = {} if stats is None else stats
        self._rounds = rounds
        self._programs = programs

    @property
    def n_rounds(self) -> int:
        return len(self._rounds) if self._rounds is not None else self._index().n_rounds

    @property
    def rounds(self) -> tuple[Round, ...]:
        """Every bucket as objects. A compact plan builds them on first access (and keeps them)."""
        if self._rounds is None:
            self._rounds = self._index().all_rounds()
        return self._rounds

    def _index(self) -> RankPrograms:
        if self._programs is None:
            assert self._rounds is not None
            self._programs = _RoundIndex(self._rounds)
        return self._programs

    def bucket_rows(self) -> np.ndarray:
        """Per bucket: round, src, dst, bytes (the cost model's input; no objects built)."""
        return self._index().bucket_rows()

    def for_rank(self, rank: int) -> RankPlan:
        """`rank`'s program; costs its own buckets, not the plan's (indices built once)."""
        return self._index().rank_plan(rank, self.digest)

    def rank_plans(self, ranks: Iterable[int] | None = None) -> Iterator[RankPlan]:
        """Programs of `ranks` (default: every rank), in order, each equal to `for_rank`'s: the
        way to cut many (a coordinator sending every rank its program), batched in one pass."""
        chosen = range(len(self.ranks)) if ranks is None else ranks
        return self._index().rank_plans(chosen, self.digest)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SyncPlan):
            return NotImplemented
        same = (self.ranks, self.digest, self.relay) == (other.ranks, other.digest, other.relay)
        return same and self.rounds == other.rounds

    def __hash__(self) -> int:
        return hash((self.digest, len(self.ranks)))

    def __repr__(self) -> str:
        return f"SyncPlan(ranks={len(self.ranks)}, rounds={self.n_rounds}, digest={self.digest[:16]!r})"
