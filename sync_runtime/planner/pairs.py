"""The direct pairs of a plan, each a pattern shared with every pair of the same shape.

Every destination replica at one position shares one needs list (needs.py). Its needs are grouped
once into *segments*, one per holder set (the ranks that hold identical copies). A destination
rank's choice of one holder per segment decides its (src, dst) pairs; a pair is then a *pattern*
(which segments of which needs list, packed into buckets) plus its two ranks. Patterns repeat
across replicas and positions (the same segments go to one sender), so they are packed once.
A scheduled bucket is a `BucketRef`; program.py turns them into arrays.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sync_runtime.core.plan import Transfer
from sync_runtime.planner.needs import Need, encode_needs, int_section
from sync_runtime.planner.senders import Choice
from sync_runtime.planner.tables import NeedTable

Segments = list[tuple[tuple[int, ...], list[int]]]
"""A needs list's holder sets, in first-appearance order, with their need indices."""


class BucketRef:
    """A scheduled bucket before it becomes arrays: bucket `k` of pair `pair` (or a relay copy)."""

    __slots__ = ("dst_rank", "k", "nbytes", "pair", "relayed", "src_rank")

    def __init__(self, src_rank: int, dst_rank: int, nbytes: int, pair: int, k: int, relayed: bool):
        self.src_rank, self.dst_rank, self.nbytes = src_rank, dst_rank, nbytes
        self.pair, self.k, self.relayed = pair, k, relayed

    def relay_copy(self, forwarder: int, receiver: int) -> BucketRef:
        """The same bytes forwarded by a destination that received them (see schedule.py)."""
        return BucketRef(forwarder, receiver, self.nbytes, self.pair, self.k, True)


@dataclass(slots=True)
class Pattern:
    """Which needs of `needs` one pair carries, in order, cut into buckets."""

    needs: list[Need]
    order: list[int]
    bounds: list[int]
    """Bucket k carries `order[bounds[k]:bounds[k + 1]]`."""
    sizes: list[int]


def _pack(needs: list[Need], order: list[int], bucket_bytes: int) -> tuple[list[int], list[int]]:
    """Greedy in-order packing up to `bucket_bytes` (as schedule.pack_buckets does for transfers)."""
    bounds, sizes, size = [0], [], 0
    for pos, i in enumerate(order):
        n = needs[i].nbytes
        if size + n > bucket_bytes and pos > bounds[-1]:
            bounds.append(pos)
            sizes.append(size)
            size = 0
        size += n
    if len(order) > bounds[-1]:
        bounds.append(len(order))
        sizes.append(size)
    return bounds, sizes


class PairBook:
    """The direct pairs of a plan, each a pattern shared with every pair of the same shape."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.patterns: list[Pattern] = []
        self._pattern_ids: dict[tuple, int] = {}
        self._segments: dict[int, Segments] = {}
        self._alive: list[list[Need]] = []  # keys are ids: keep the lists alive
        self.pair_src: list[int] = []
        self.pair_dst: list[int] = []
        self.pair_pattern: list[int] = []

    def segments(self, needs: list[Need]) -> Segments:
        found = self._segments.get(id(needs))
        if found is None:
            groups: dict[tuple[int, ...], list[int]] = {}
            for i, need in enumerate(needs):
                groups.setdefault(need.cell.ranks, []).append(i)
            found = self._segments[id(needs)] = list(groups.items())
            self._alive.append(needs)
        return found

    def add(self, dst: int, needs: list[Need], choice: Choice) -> None:
        """File `dst`'s pairs: per sender, the segments (or single needs) it sends."""
        parts: dict[int, list[int | tuple[int, ...]]] = {}
        for seg, (ranks, members) in enumerate(self.segments(needs)):
            c = choice.get(ranks, 0)
            if isinstance(c, int):
                parts.setdefault(ranks[c], []).append(seg)
                continue
            by_holder: dict[int, list[int]] = {}
            for j in members:
                by_holder.setdefault(c[j], []).append(j)
            for h, js in by_holder.items():
                parts.setdefault(ranks[h], []).append(tuple(js))
        for src, ps in parts.items():
            self.pair_src.append(src)
            self.pair_dst.append(dst)
            self.pair_pattern.append(self.pattern(needs, tuple(ps)))

    def pattern(self, needs: list[Need], parts: tuple[int | tuple[int, ...], ...]) -> int:
        key = (id(needs), parts)
        pid = self._pattern_ids.get(key)
        if pid is None:
            segs = self._segments[id(needs)]
            order = [i for p in parts for i in (segs[p][1] if isinstance(p, int) else p)]
            bounds, sizes = _pack(needs, order, self.bucket_bytes)
            pid = self._pattern_ids[key] = len(self.patterns)
            self.patterns.append(Pattern(needs, order, bounds, sizes))
        return pid

    def refs(self, pair: int) -> list[BucketRef]:
        src, dst = self.pair_src[pair], self.pair_dst[pair]
        sizes = self.patterns[self.pair_pattern[pair]].sizes
        return [BucketRef(src, dst, n, pair, k, False) for k, n in enumerate(sizes)]

    def transfers(self, pair: int, k: int, src: int, dst: int, relayed: bool) -> tuple[Transfer, ...]:
        """Bucket `k` of `pair` as transfers (a relay copy reads where the forwarder stored it)."""
        pattern = self.patterns[self.pair_pattern[pair]]
        needs, sender = pattern.needs, self.pair_src[pair]
        picked = [needs[i] for i in pattern.order[pattern.bounds[k] : pattern.bounds[k + 1]]]
        if relayed:
            return tuple(
                Transfer(src, dst, n.tensor, n.dst_name, n.dst_box, n.dst_name, n.dst_box, n.nbytes)
                for n in picked
            )
        out = []
        ranks, h = (), 0
        for need in picked:
            if need.cell.ranks is not ranks:  # consecutive needs mostly share a holder set
                ranks = need.cell.ranks
                h = ranks.index(sender)
            _, name, box = need.source(h)
            out.append(Transfer(src, dst, need.tensor, name, box, need.dst_name, need.dst_box, need.nbytes))
        return tuple(out)

    def table(self) -> NeedTable:
        """The needs and patterns as flat columns (for cutting packed rank programs)."""
        lists: dict[int, int] = {}
        for p in self.patterns:
            lists.setdefault(id(p.needs), len(lists))
        by_id = {id(p.needs): p.needs for p in self.patterns}
        return NeedTable(
            [by_id[i] for i in lists], [(lists[id(p.needs)], p.order, p.bounds) for p in self.patterns]
        )

    def content_hash(self) -> bytes:
        """sha256 of what every transfer is made of: needs, patterns, pairs (for the digest).

        Every section is length-prefixed, so the byte stream decodes one way only."""
        lists: dict[int, int] = {}
        encoded: list[bytes] = []
        heads: list[int] = []  # per pattern: its needs list, len(order), len(bounds)
        flat: list[int] = []  # per pattern: order, then bounds
        for p in self.patterns:
            index = lists.get(id(p.needs))
            if index is None:
                index = lists[id(p.needs)] = len(encoded)
                encoded.append(encode_needs(p.needs))
            heads.extend((index, len(p.order), len(p.bounds)))
            flat.extend(p.order)
            flat.extend(p.bounds)
        h = hashlib.sha256(int_section([len(encoded)]))
        for chunk in encoded:
            h.update(chunk)
        for column in (heads, flat, self.pair_src, self.pair_dst, self.pair_pattern):
            h.update(int_section(column))
        return h.digest()
