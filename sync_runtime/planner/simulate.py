"""Execute a plan in-process on numpy arrays: the reference semantics of a plan.

Per round, every bucket is first packed at its sender (its transfers' regions, in order, into one
flat byte buffer) and then unpacked at its receiver, so a relay that forwards data before it
arrived reads stale bytes and is caught. Every destination element written is counted: a correct
plan writes each element a destination piece covers exactly once and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sync_runtime.core.layouts.base import Box, RankShard
from sync_runtime.core.layouts.materialize import bits_dtype, materialize
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.plan import Bucket, SyncPlan
from sync_runtime.core.topology import Role

Locals = dict[int, dict[str, np.ndarray]]


class SimulationError(ValueError):
    """A plan that cannot run on the given tensors (missing tensor, bad box, size mismatch)."""


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def _region(arrays: Mapping[str, np.ndarray], rank: int, name: str, box: Box) -> np.ndarray:
    array = arrays.get(name)
    if array is None:
        raise SimulationError(f"rank {rank} has no tensor {name!r}")
    if len(box) != array.ndim or any(lo < 0 or hi > n for (lo, hi), n in zip(box, array.shape, strict=True)):
        raise SimulationError(f"rank {rank} tensor {name} {array.shape}: box {list(box)} out of bounds")
    return array[_slices(box)]


def _pack(bucket: Bucket, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    parts = [
        np.ascontiguousarray(_region(arrays, bucket.src_rank, t.src_name, t.src_box)).view(np.uint8).ravel()
        for t in bucket.transfers
    ]
    buffer = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    if buffer.nbytes != bucket.nbytes:
        raise SimulationError(
            f"bucket {bucket.src_rank}->{bucket.dst_rank}: packed {buffer.nbytes} bytes, "
            f"plan says {bucket.nbytes}"
        )
    return buffer


def _unpack(
    bucket: Bucket, buffer: np.ndarray, arrays: Mapping[str, np.ndarray], counts: Mapping[str, np.ndarray]
) -> None:
    offset = 0
    for t in bucket.transfers:
        region = _region(arrays, bucket.dst_rank, t.dst_name, t.dst_box)
        size = region.size * region.itemsize
        if size != t.nbytes:
            raise SimulationError(
                f"transfer {t.tensor} to rank {bucket.dst_rank}: {size} bytes, plan says {t.nbytes}"
            )
        region[...] = buffer[offset : offset + size].view(region.dtype).reshape(region.shape)
        counts[t.dst_name][_slices(t.dst_box)] += 1
        offset += size


def simulate(
    plan: SyncPlan,
    src_locals: Mapping[int, Mapping[str, np.ndarray]],
    dst_shapes: Mapping[int, Mapping[str, tuple[tuple[int, ...], np.dtype]]],
) -> tuple[Locals, dict[int, dict[str, np.ndarray]]]:
    """Run `plan`; returns (destination local tensors, per-element write counts).

    `src_locals[rank][name]` are the source ranks' local tensors; `dst_shapes[rank][name]` gives
    (shape, dtype) of every destination rank's local tensors, which start zero-filled.
    """
    dst_locals: Locals = {
        rank: {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in tensors.items()}
        for rank, tensors in dst_shapes.items()
    }
    counts = {
        rank: {name: np.zeros(a.shape, dtype=np.int32) for name, a in tensors.items()}
        for rank, tensors in dst_locals.items()
    }

    def arrays_of(rank: int, role: str) -> Mapping[str, np.ndarray]:
        table = src_locals if role == "source" else dst_locals
        arrays = table.get(rank)
        if arrays is None:
            raise SimulationError(f"no local tensors given for {role} rank {rank}")
        return arrays

    for rnd in plan.rounds:
        buffers = [
            (b, _pack(b, arrays_of(b.src_rank, plan.ranks[b.src_rank].role.value))) for b in rnd.buckets
        ]
        for bucket, buffer in buffers:
            _unpack(bucket, buffer, arrays_of(bucket.dst_rank, "destination"), counts[bucket.dst_rank])
    return dst_locals, counts


def random_canonical(manifest: Manifest, seed: int = 0) -> dict[str, np.ndarray]:
    """Random bit patterns for every canonical tensor (bit-exact dtypes, see layouts.materialize)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in manifest.tensors:
        dtype = bits_dtype(t.dtype)
        out[t.name] = rng.integers(0, np.iinfo(dtype).max, size=t.shape, dtype=dtype, endpoint=True)
    return out


def check_plan(
    plan: SyncPlan, manifest: Manifest, shards: Mapping[int, RankShard], seed: int = 0
) -> list[str]:
    """Simulate `plan` on random weights; the problems found (empty when the plan is correct).

    `shards` gives every global rank's shard. Each destination rank must end up equal to
    `materialize(its shard, canon)` with every element its pieces cover written exactly once and
    no other element written.
    """
    canon = random_canonical(manifest, seed)
    roles = {rank: plan.ranks[rank].role for rank in shards}
    src_locals = {r: materialize(s, canon) for r, s in shards.items() if roles[r] is Role.SOURCE}
    expected = {r: materialize(s, canon) for r, s in shards.items() if roles[r] is Role.DESTINATION}
    shapes = {r: {n: (a.shape, a.dtype) for n, a in arrays.items()} for r, arrays in expected.items()}
    got, counts = simulate(plan, src_locals, shapes)
    problems = []
    for rank, arrays in expected.items():
        want_counts = {n: np.zeros(a.shape, dtype=np.int32) for n, a in arrays.items()}
        for p in shards[rank].pieces:
            want_counts[p.local_name][_slices(p.local_box)] += 1
        for name, want in arrays.items():
            if not np.array_equal(got[rank][name], want):
                bad = int(np.count_nonzero(got[rank][name] != want))
                problems.append(f"rank {rank} {name}: {bad} of {want.size} elements differ")
            if not np.array_equal(counts[rank][name], want_counts[name]):
                bad = int(np.count_nonzero(counts[rank][name] != want_counts[name]))
                problems.append(f"rank {rank} {name}: {bad} elements written other than exactly once")
    return problems
