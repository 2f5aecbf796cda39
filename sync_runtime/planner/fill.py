"""Full buckets for the lane schedule: needs re-cut so each holder set's buckets fill exactly.

The lane schedule (lanes.py) moves one bucket per lane per round, so a round lasts as long as a
full bucket whatever the bucket holds. Needs are cut at the bucket size but packed whole: two
29 MB experts in a 64 MiB bucket fill it to 87% and stretch the cycle by as much (Kimi-K2,
4096 destinations: predicted 1.13x the floor). Here, per needs list and holder set (one lane
stream, program.py's segment), the need that would overflow a bucket is split by rows into a
head that tops the bucket up and a tail that opens the next one. Bytes and coverage are
unchanged: a need becomes two adjacent needs of the same cell, so the wire still carries the
lower bound and every destination element is still written once.
"""

from __future__ import annotations

from collections.abc import Sequence

from sync_runtime.core.layouts.base import Box, box_numel
from sync_runtime.planner.needs import Need
from sync_runtime.planner.refine import to_local

Instance = tuple[int, list[Need]]


def _head(box: Box, itemsize: int, room: int) -> tuple[Box, Box] | None:
    """`box` cut along its first dim of extent > 1 into the most rows that fit `room` bytes."""
    dim = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), None)
    if dim is None:
        return None
    lo, hi = box[dim]
    rows = room // (box_numel(box) * itemsize // (hi - lo))
    if rows <= 0 or rows >= hi - lo:
        return None
    return (
        (*box[:dim], (lo, lo + rows), *box[dim + 1 :]),
        (*box[:dim], (lo + rows, hi), *box[dim + 1 :]),
    )


def _sub(need: Need, canon: Box, itemsize: int) -> Need:
    return Need(
        tensor=need.tensor,
        cell=need.cell,
        canon_box=canon,
        dst_name=need.dst_name,
        dst_box=to_local(canon, need.canon_box, need.dst_box),
        nbytes=box_numel(canon) * itemsize,
        sources=[None] * len(need.cell.holders),
    )


def _refill(needs: list[Need], bucket_bytes: int) -> list[Need]:
    """`needs` with overflowing needs split (order kept; each holder set packs as program._pack)."""
    out: list[Need] = []
    used: dict[tuple[int, ...], int] = {}
    for need in needs:
        ranks = need.cell.ranks
        size = used.get(ranks, 0)
        if size and size + need.nbytes > bucket_bytes:
            itemsize = need.nbytes // box_numel(need.canon_box)
            cut = _head(need.canon_box, itemsize, bucket_bytes - size)
            if cut is not None:
                head, tail = _sub(need, cut[0], itemsize), _sub(need, cut[1], itemsize)
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
