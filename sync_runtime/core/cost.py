"""Link cost model: how long a plan's rounds take on a simple network (design §5 and 9).

Model. Rounds run one after another (a round ends when its slowest rank is done). Inside a round
a rank sends and receives concurrently (full-duplex links), so its time is

    max(inter-node send, inter-node recv) bytes / nic_bytes_per_s
  + max(intra-node send, intra-node recv) bytes / intra_node_bytes_per_s
  + messages * latency_s

where a pair is intra-node when both ranks report the same `RankCoord.node`, and messages counts
the buckets the rank sends plus those it receives in that round. NIC and intra-node traffic are
added rather than overlapped: a pessimistic choice that keeps the model monotone. The round's time
is the maximum over its ranks; the plan's time is the sum over rounds.

The physical floor (design §8) ignores rounds and latency: every destination rank must pull its
own bytes through its own NIC, so no plan beats max over ranks of received bytes / NIC bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sync_runtime.core.plan import SyncPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkCost:
    """Bandwidths and per-message latency of the links between ranks."""

    nic_bytes_per_s: float = 50e9
    """Per-GPU network bandwidth between nodes (400 Gb/s)."""
    intra_node_bytes_per_s: float = 450e9
    """Per-GPU bandwidth to another GPU of the same node (NVLink class)."""
    latency_s: float = 20e-6
    """Fixed cost of one message (one bucket), paid by sender and receiver."""

    def __post_init__(self) -> None:
        for name in ("nic_bytes_per_s", "intra_node_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkCost.{name}={getattr(self, name)!r}: must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"LinkCost.latency_s={self.latency_s!r}: must be >= 0")


@dataclass(frozen=True, slots=True)
class BucketArrays:
    """The plan's buckets as flat arrays (one entry per bucket), the form the model computes on."""

    round_index: np.ndarray
    src_rank: np.ndarray
    dst_rank: np.ndarray
    nbytes: np.ndarray
    intra: np.ndarray
    """True where source and destination rank share a node."""
    n_ranks: int
    n_rounds: int


def bucket_arrays(plan: SyncPlan) -> BucketArrays:
    nodes = [c.node for c in plan.ranks]
    arr = plan.bucket_rows()  # compact plans answer from their arrays, without building buckets
    node_ids = _node_ids(nodes)
    intra = node_ids[arr[:, 1]] == node_ids[arr[:, 2]] if len(arr) else np.zeros(0, dtype=bool)
    return BucketArrays(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], intra, len(nodes), plan.n_rounds)


def _node_ids(nodes: Sequence[str]) -> np.ndarray:
    index: dict[str, int] = {}
    return np.array([index.setdefault(n, len(index)) for n in nodes], dtype=np.int64)


SLOTS_PER_PASS = 1 << 20
"""(round, rank) slots `round_seconds` works on at once. Rounds go in slices so its per-slot
arrays stay a few MB and are reused from slice to slice: one pass over a 4,096-destination plan
(6.4 M slots) allocated ~0.5 GB afresh, and its page faults were most of the model's time."""


def round_seconds(buckets: BucketArrays, cost: LinkCost) -> np.ndarray:
    """Predicted duration of every round (see the module docstring for the model)."""
    if buckets.n_rounds == 0:
        return np.zeros(0)
    columns = (buckets.round_index, buckets.src_rank, buckets.dst_rank, buckets.nbytes, buckets.intra)
    if not bool((columns[0][1:] >= columns[0][:-1]).all()):  # plans list buckets in round order
        order = np.argsort(columns[0], kind="stable")
        columns = tuple(c[order] for c in columns)
    step = max(1, SLOTS_PER_PASS // buckets.n_ranks)
    firsts = np.arange(0, buckets.n_rounds, step)
    edges = np.searchsorted(columns[0], np.append(firsts, buckets.n_rounds)).tolist()
    out = np.empty(buckets.n_rounds)
    for n, first in enumerate(firsts.tolist()):
        rounds = min(step, buckets.n_rounds - first)
        rows = [c[edges[n] : edges[n + 1]] for c in columns]
        out[first : first + rounds] = _slice_seconds(rows, first, rounds, buckets.n_ranks, cost)
    return out


def _slice_seconds(
    rows: Sequence[np.ndarray], first: int, rounds: int, n_ranks: int, cost: LinkCost
) -> np.ndarray:
    """Durations of rounds first .. first + rounds - 1, from their buckets `rows` (round, src,
    dst, bytes, intra); each (round, rank) slot index is computed once per side."""
    rnd, src, dst, nbytes, intra = rows
    size = rounds * n_ranks
    at_src = (rnd - first) * n_ranks + src
    at_dst = (rnd - first) * n_ranks + dst
    weights = nbytes.astype(np.float64)
    nic = _busiest_side(at_src, at_dst, weights, ~intra, size)
    nvl = _busiest_side(at_src, at_dst, weights, intra, size)
    messages = np.bincount(at_src, minlength=size) + np.bincount(at_dst, minlength=size)
    rank_time = nic / cost.nic_bytes_per_s + nvl / cost.intra_node_bytes_per_s + messages * cost.latency_s
    return rank_time.reshape(rounds, n_ranks).max(axis=1)


def _busiest_side(
    at_src: np.ndarray, at_dst: np.ndarray, weights: np.ndarray, mask: np.ndarray, size: int
) -> np.ndarray | float:
    """Per slot, the larger of bytes sent and received over the buckets in `mask`; 0.0 when
    none is (adding 0.0 is exact, so skipping an empty link class changes no figure)."""
    if not mask.any():
        return 0.0
    if not mask.all():
        at_src, at_dst, weights = at_src[mask], at_dst[mask], weights[mask]
    sent = np.bincount(at_src, weights=weights, minlength=size)
    return np.maximum(sent, np.bincount(at_dst, weights=weights, minlength=size), out=sent)


def predict_seconds_arrays(buckets: BucketArrays, cost: LinkCost) -> float:
    return float(round_seconds(buckets, cost).sum())


def floor_seconds_arrays(buckets: BucketArrays, cost: LinkCost) -> float:
    recv = bytes_per_rank(buckets.dst_rank, buckets.nbytes, buckets.n_ranks)
    return float(recv.max() / cost.nic_bytes_per_s) if len(recv) else 0.0


def bytes_per_rank(ranks: np.ndarray, nbytes: np.ndarray, n_ranks: int) -> np.ndarray:
    """Per rank, the sum of `nbytes` over the buckets it appears in as `ranks` (float64: exact
    below 2**53). A slice at a time: bincount's float weights are a converted copy of what it is
    given, 68 MB of fresh memory for a whole 8.5 M bucket column."""
    out = np.zeros(n_ranks)
    for at in range(0, len(ranks), SLOTS_PER_PASS):
        part = slice(at, at + SLOTS_PER_PASS)
        out += np.bincount(ranks[part], weights=nbytes[part], minlength=n_ranks)
    return out


def predict_seconds(plan: SyncPlan, cost: LinkCost | None = None) -> float:
    """Predicted wall time of the plan's transfer phase under `cost` (default `LinkCost()`)."""
    return predict_seconds_arrays(bucket_arrays(plan), cost or LinkCost())


def floor_seconds(plan: SyncPlan, cost: LinkCost | None = None) -> float:
    """Physical floor: the largest per-rank receive volume through one NIC (design §8)."""
    return floor_seconds_arrays(bucket_arrays(plan), cost or LinkCost())
