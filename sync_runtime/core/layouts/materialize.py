"""Build a rank's local tensors from canonical ones by applying its pieces, and the inverse.

Pure numpy, for tests, the demo and dumps. Tensors are raw element bits: uint16 arrays stand for
bfloat16/float16 bytes (uint32 for float32, uint8 for float8), so copies are bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sync_runtime.core.layouts.base import Box, RankShard
from sync_runtime.core.manifest import DTYPE_BYTES, Manifest

_BITS: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def bits_dtype(dtype: str) -> np.dtype:
    """The unsigned integer numpy dtype that holds one element of torch dtype `dtype` bit-exactly."""
    return np.dtype(_BITS[DTYPE_BYTES[dtype]])


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def materialize(shard: RankShard, canon: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rank's local tensors: zeros where no piece lands (vocab padding), else canonical bytes."""
    local = {t.name: np.zeros(t.shape, dtype=bits_dtype(t.dtype)) for t in shard.tensors}
    for p in shard.pieces:
        dst = local[p.local_name]
        region = dst[_slices(p.local_box)]
        region[...] = canon[p.tensor][_slices(p.canon_box)].reshape(region.shape)
    return local


def reconstruct(
    shards: Sequence[RankShard],
    locals_by_rank: Sequence[Mapping[str, np.ndarray]],
    manifest: Manifest,
) -> dict[str, np.ndarray]:
    """Canonical tensors rebuilt from the ranks' local tensors (`locals_by_rank[i]` belongs to `shards[i]`).

    Elements that several ranks hold must agree; ValueError names the tensor otherwise.
    Elements no rank holds stay zero (use `coverage` to find them).
    """
    if len(shards) != len(locals_by_rank):
        raise ValueError(f"{len(shards)} shards but {len(locals_by_rank)} sets of local tensors")
    out = {t.name: np.zeros(t.shape, dtype=bits_dtype(t.dtype)) for t in manifest.tensors}
    seen = {t.name: np.zeros(t.shape, dtype=bool) for t in manifest.tensors}
    for shard, local in zip(shards, locals_by_rank, strict=True):
        for p in shard.pieces:
            sl = _slices(p.canon_box)
            target = out[p.tensor][sl]
            values = local[p.local_name][_slices(p.local_box)].reshape(target.shape)
            mask = seen[p.tensor][sl]
            if np.any(mask & (target != values)):
                raise ValueError(f"{p.tensor}{list(p.canon_box)}: ranks disagree (rank {shard.coord.key})")
            target[...] = values
            mask[...] = True
    return out


def coverage(shards: Sequence[RankShard], manifest: Manifest) -> dict[str, np.ndarray]:
    """How many pieces of `shards` cover each canonical element (int32 arrays of canonical shapes)."""
    counts = {t.name: np.zeros(t.shape, dtype=np.int32) for t in manifest.tensors}
    for shard in shards:
        for p in shard.pieces:
            counts[p.tensor][_slices(p.canon_box)] += 1
    return counts
