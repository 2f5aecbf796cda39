"""Full buckets for the lane schedule: needs re-cut so each holder set's buckets fill exactly.

The lane schedule (lanes.py) moves one bucket per lane per round, so a round lasts as long as a
full bucket whatever the bucket holds. Needs are cut at the bucket size but packed whole: two
29 MB experts in a 64 MiB bucket fill it to 87% and stretch the cycle by as much (Kimi-K2,
4096 destinations: predicted 1.13x the floor). Here, per needs list and holder set (one lane
stream, pairs.py's segment), the need that would overflow a bucket is split by rows into a
head that tops the bucket up and a tail that opens the next one. Bytes and coverage are
unchanged: a need becomes two adjacent needs of the same cell, so the wire still carries the
lower bound and every destination element is still written once.
"""

from __future__ import annotations

from collections.abc import Sequence

from sync_runtime.core.layouts.base import Box
from sync_runtime.planner.needs import Need

Instance = tuple[int, list[Need]]


def _cut(box: Box, dim: int, at: int) -> tuple[Box, Box]:
    """`box` cut along `dim` before index `at`."""
    lo, hi = box[dim]
    return (*box[:dim], (lo, at), *box[dim + 1 :]), (*box[:dim], (at, hi), *box[dim + 1 :])


def _head(need: Need, room: int) -> tuple[Need, Need] | None:
    """`need` cut along its first dim of extent > 1 into the most rows that fit `room` bytes, and
    the rest. Its destination box is cut the same rows: a local box is the canonical one under
    leading unit dims (layouts.base), so no `to_local` is needed."""
    box = need.canon_box
    dim = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), None)
    if dim is None:
        return None
    lo, hi = box[dim]
    row_bytes = need.nbytes // (hi - lo)
    rows = room // row_bytes
    if rows <= 0 or rows >= hi - lo:
        return None
    local = len(need.dst_box) - len(box) + dim
    canon = _cut(box, dim, lo + rows)
    dst = _cut(need.dst_box, local, need.dst_box[local][0] + rows)
    nbytes = rows * row_bytes
    return _sub(need, canon[0], dst[0], nbytes), _sub(need, canon[1], dst[1], need.nbytes - nbytes)


def _sub(need: Need, canon: Box, dst: Box, nbytes: int) -> Need:
    return Need(
        tensor=need.tensor,
        cell=need.cell,
        canon_box=canon,
        dst_name=need.dst_name,
        dst_box=dst,
        nbytes=nbytes,
    )


def _refill(needs: list[Need], bucket_bytes: int) -> list[Need]:
    """`needs` with overflowing needs split (order kept; each holder set packs as pairs._pack)."""
    out: list[Need] = []
    used: dict[tuple[int, ...], int] = {}
    for need in needs:
        ranks = need.cell.ranks
        size = used.get(ranks, 0)
        if size and size + need.nbytes > bucket_bytes:
            cut = _head(need, bucket_bytes - size)
            if cut is not None:
                head, tail = cut
                out.append(head)
                size += head.nbytes
                need = tail
            size = 0  # the (rest of the) need opens the next bucket
        out.append(need)
        used[ranks] = size + need.nbytes
    return out


def refill(instances: Sequence[Instance], bucket_bytes: int) -> list[Instance]:
    """The instances with their needs lists re-cut (one new list per shared list)."""
    lists: dict[int, list[Need]] = {}
    out: list[Instance] = []
    for dst, needs in instances:
        found = lists.get(id(needs))
        if found is None:
            found = lists[id(needs)] = _refill(needs, bucket_bytes)
        out.append((dst, found))
    return out
