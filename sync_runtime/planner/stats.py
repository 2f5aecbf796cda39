"""Summary figures of a plan (`SyncPlan.stats`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sync_runtime.core.cost import (
    SLOTS_PER_PASS,
    BucketArrays,
    LinkCost,
    bytes_per_rank,
    floor_seconds_arrays,
    predict_seconds_arrays,
)
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import RankCoord


def _max_mean(per_rank: np.ndarray) -> tuple[int, float]:
    active = per_rank[per_rank > 0]
    return (int(active.max()), float(active.mean())) if len(active) else (0, 0.0)


Fingerprint = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""The schedule, per bucket in round order: round, src, dst, bytes, transfer count (int64
columns; kept apart, not stacked: a stack copies ~340 MB at 8.5 M buckets)."""


def schedule_arrays(
    ranks: Sequence[RankCoord], schedule: Sequence[np.ndarray], n_rounds: int
) -> BucketArrays:
    """The cost model's view of a schedule fingerprint (its first four columns are used)."""
    node_index: dict[str, int] = {}
    # 32-bit ids: the two per-bucket gathers below then write half the memory
    node = np.array([node_index.setdefault(c.node, len(node_index)) for c in ranks], dtype=np.int32)
    rnd, src, dst, nbytes = schedule[:4]
    intra = np.empty(len(src), dtype=bool)
    for at in range(0, len(src), SLOTS_PER_PASS):  # slices: the gathers' temporaries are reused
        part = slice(at, at + SLOTS_PER_PASS)
        np.equal(node[src[part]], node[dst[part]], out=intra[part])
    return BucketArrays(rnd, src, dst, nbytes, intra, len(ranks), n_rounds)


def plan_stats(plan: SyncPlan, schedule: Fingerprint, tensors: int, lower_bound: int, cost: LinkCost) -> dict:
    """Stats from the schedule fingerprint (per bucket: round, src, dst, bytes, transfers).

    Means are over the ranks that send (resp. receive) anything, so idle ranks do not flatter
    the balance figures.
    """
    n = len(plan.ranks)
    arrays = schedule_arrays(plan.ranks, schedule, plan.n_rounds)
    src, dst, nbytes = arrays.src_rank, arrays.dst_rank, arrays.nbytes
    send = bytes_per_rank(src, nbytes, n).astype(np.int64)
    recv = bytes_per_rank(dst, nbytes, n).astype(np.int64)
    max_send, mean_send = _max_mean(send)
    max_recv, mean_recv = _max_mean(recv)
    return {
        "tensors": tensors,
        "transfers": int(schedule[4].sum()),
        "buckets": len(schedule[0]),
        "rounds": plan.n_rounds,
        "wire_bytes": int(nbytes.sum()),
        "lower_bound_bytes": lower_bound,
        "send_bytes": {r: int(send[r]) for r in range(n)},
        "recv_bytes": {r: int(recv[r]) for r in range(n)},
        "max_send_bytes": max_send,
        "mean_send_bytes": mean_send,
        "max_recv_bytes": max_recv,
        "mean_recv_bytes": mean_recv,
        "predicted_seconds": predict_seconds_arrays(arrays, cost),
        "floor_seconds": floor_seconds_arrays(arrays, cost),
        "relay": plan.relay,
    }
