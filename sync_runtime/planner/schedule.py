"""Transfers, buckets and rounds.

Buckets: the transfers of one (src, dst) pair, in plan order, packed greedily up to the bucket size.

Rounds: a greedy edge colouring of the bipartite (sender, receiver) multigraph whose edges are
buckets, under per-round capacities (each rank sends at most `cap` and receives at most `cap`
bytes, and receives from at most `max_fan_in` distinct senders). Each round is filled receiver
by receiver, most remaining bytes first, so the ranks that bound the plan's length are served
every round. A receiver takes from its pairs that can fill a round's capacity first (so small
pairs do not spend its fan-in slots), among those from the sender with the most bytes left
(the critical sender), until its capacity or fan-in is used. A round lasts as long as its busiest
rank, so once a receiver has been filled (no further largest bucket fits), later receivers of the round
(which have fewer bytes left) are held to the bytes it got: a receiver that runs ahead only makes
this round longer, it cannot make the plan shorter.

Relay: a relayed destination rank receives, from the same position of an earlier replica (its
forwarder), a copy of every bucket the forwarder receives, in the round after the forwarder got
it. Those copies are created while scheduling and queued on the (forwarder, receiver) pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sync_runtime.core.plan import Bucket, Transfer

RESORT_EVERY = 4
"""Pair priorities (remaining bytes, sender criticality) drift slowly: re-sort a receiver's pairs
every few rounds, and whenever one of them ran out, rather than every round (the sort was half the
scheduler's time on Kimi-K2)."""
MAX_MISSES = 6
"""Pairs that cannot add a bucket before a half-full receiver stops looking (see _fill_receiver)."""


@dataclass(slots=True)
class PairQueue:
    """The buckets of one (src, dst) pair still to be scheduled."""

    src: int
    dst: int
    buckets: list[Bucket]
    remaining: int
    """Bytes not yet scheduled, including relay copies not yet created."""
    total: int
    """Buckets this pair will carry in all (relay copies are created as their originals go)."""
    ready: list[int] = field(default_factory=list)
    """Per bucket (relay pairs only), the first round it may go in."""
    pos: int = 0


def pack_buckets(src: int, dst: int, transfers: Sequence[Transfer], bucket_bytes: int) -> list[Bucket]:
    """Pack one pair's transfers, in order, into buckets of at most `bucket_bytes`."""
    out: list[Bucket] = []
    start = size = 0
    for i, t in enumerate(transfers):
        n = t.nbytes
        if size + n > bucket_bytes and i > start:
            out.append(Bucket(src, dst, tuple(transfers[start:i]), size))
            start, size = i, 0
        size += n
    if len(transfers) > start:
        out.append(Bucket(src, dst, tuple(transfers[start:]), size))
    return out


def direct_queue(src: int, dst: int, buckets: list[Bucket]) -> PairQueue:
    return PairQueue(src, dst, buckets, sum(b.nbytes for b in buckets), len(buckets))


def _relay_copy(bucket: Bucket, forwarder: int, receiver: int) -> Bucket:
    """The forwarder re-sends what it received, from where it stored it."""
    transfers = tuple(
        Transfer(forwarder, receiver, t.tensor, t.dst_name, t.dst_box, t.dst_name, t.dst_box, t.nbytes)
        for t in bucket.transfers
    )
    return Bucket(forwarder, receiver, transfers, bucket.nbytes)


class _Relays:
    """Relay pair queues, keyed by forwarder, filled as the forwarder's buckets are scheduled."""

    def __init__(self, queues: Mapping[int, Sequence[PairQueue]]):
        self.by_forwarder = queues

    def scheduled(self, bucket: Bucket, index: int) -> None:
        copy = getattr(bucket, "relay_copy", None)  # compact refs copy themselves (planner/pairs.py)
        for q in self.by_forwarder.get(bucket.dst_rank, ()):
            q.buckets.append(copy(q.src, q.dst) if copy else _relay_copy(bucket, q.src, q.dst))
            q.ready.append(index + 1)


def schedule_rounds(
    queues: Iterable[PairQueue],
    n_ranks: int,
    cap: int,
    max_fan_in: int,
    relays: Sequence[PairQueue] = (),
    *,
    pacing: bool = True,
) -> list[list[Bucket]]:
    """Assign every bucket to a round (see the module docstring). Buckets must each be <= cap.

    `pacing` holds a round's later receivers to the first full one's bytes.
    """
    by_dst, send_left, recv_left = _index(queues, relays, n_ranks)
    forwarders: dict[int, list[PairQueue]] = {}
    for q in relays:
        forwarders.setdefault(q.src, []).append(q)
    relay = _Relays(forwarders)
    # A receiver holding this much could not take one more of the largest buckets: it is full.
    full_at = max(1, cap - max((b.nbytes for q in by_dst_queues(by_dst) for b in q.buckets), default=0))
    rounds: list[list[Bucket]] = []
    changed: set[int] = set()
    """Receivers whose pairs changed since the last full re-sort."""
    while by_dst:
        index = len(rounds)
        current: list[Bucket] = []
        send_used: dict[int, int] = {}
        pace = 0  # most bytes a receiver got this round; see the module docstring
        for dst in sorted(by_dst, key=lambda d: (-recv_left[d], d)):
            pending = by_dst[dst]
            if index % RESORT_EVERY == 0 or dst in changed:
                pending.sort(key=lambda q: (-min(q.remaining, cap), -send_left[q.src], q.src))
                changed.discard(dst)
            limit = pace if pacing and pace >= full_at else cap
            used, finished = _fill_receiver(pending, index, limit, max_fan_in, send_used, current)
            pace = max(pace, used)
            recv_left[dst] -= used
            if finished:
                pending[:] = [q for q in pending if q.pos < q.total]
                changed.add(dst)
                if not pending:
                    del by_dst[dst]
        assert current, "no bucket could be scheduled: relay dependencies cannot be met"
        for b in current:
            send_left[b.src_rank] -= b.nbytes
            if forwarders:
                relay.scheduled(b, index)
        rounds.append(current)
    return rounds


def _index(
    queues: Iterable[PairQueue], relays: Sequence[PairQueue], n_ranks: int
) -> tuple[dict[int, list[PairQueue]], list[int], list[int]]:
    """Pairs by receiver, and the bytes every rank has left to send and to receive."""
    send_left = [0] * n_ranks
    recv_left = [0] * n_ranks
    by_dst: dict[int, list[PairQueue]] = {}
    for q in [*queues, *relays]:
        if q.total == 0:
            continue
        by_dst.setdefault(q.dst, []).append(q)
        send_left[q.src] += q.remaining
        recv_left[q.dst] += q.remaining
    return by_dst, send_left, recv_left


def by_dst_queues(by_dst: Mapping[int, list[PairQueue]]) -> Iterable[PairQueue]:
    return (q for queues in by_dst.values() for q in queues)


def _fill_receiver(
    pending: list[PairQueue],
    index: int,
    cap: int,
    max_fan_in: int,
    send_used: dict[int, int],
    out: list[Bucket],
) -> tuple[int, bool]:
    """Give one receiver as many buckets as fit this round.

    Returns the bytes it receives and whether one of its pairs has no bucket left. Once the
    receiver is half full, a few pairs that cannot add anything end the search: topping up the
    last bytes is rarely possible and scanning every pair every round dominated planning time.
    """
    used = fan = misses = 0
    finished = False
    for q in pending:
        if fan == max_fan_in or used == cap or misses > MAX_MISSES:  # cap: this receiver's limit
            break
        sent = send_used.get(q.src, 0)
        pos, buckets, ready = q.pos, q.buckets, q.ready
        start = pos
        while pos < len(buckets):
            b = buckets[pos]
            if used + b.nbytes > cap or sent + b.nbytes > cap or (ready and ready[pos] > index):
                break
            out.append(b)
            used += b.nbytes
            sent += b.nbytes
            q.remaining -= b.nbytes
            pos += 1
        if pos > start:
            q.pos = pos
            fan += 1
            send_used[q.src] = sent
            finished = finished or pos == q.total
        elif 2 * used >= cap:
            misses += 1
    return used, finished
