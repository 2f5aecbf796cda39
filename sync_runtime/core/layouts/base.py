"""What a layout is: for one rank, which slice of which canonical tensor it holds, under which name.

A layout is data: a function from (model, parallel spec, rank coordinate) to a `RankShard`,
the list of local tensors of that rank and the `Piece`s that tie each local region to a
canonical region. Everything downstream (planner, transfer engine, tests) works on pieces only.

Box convention: a box is a tuple of half-open (start, stop) ranges, one per dim. A piece's
`local_box` is its `canon_box` with zero or more extra *leading* dims of extent 1 (the expert
index of stacked MoE tensors such as vLLM's w13_weight), so the elements of the two boxes are
in the same row-major order and `local[local_box] = canon[canon_box].reshape(...)` is exact.
Local regions that no piece covers are zero (vocab padding rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec, RankCoord

Range = tuple[int, int]
Box = tuple[Range, ...]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, s) for s in shape)


@dataclass(frozen=True, slots=True)
class Piece:
    """A region of canonical tensor `tensor` stored at `local_box` of the rank's tensor `local_name`."""

    tensor: str
    canon_box: Box
    local_name: str
    local_box: Box


@dataclass(frozen=True, slots=True)
class LocalTensorMeta:
    """A tensor as one rank holds it, under its layout's name (manifest.TensorMeta is the
    canonical full tensor; a local one is a shard, often fused from several canonical ones)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class RankShard:
    """Everything one rank holds under a layout."""

    coord: RankCoord
    tensors: tuple[LocalTensorMeta, ...]
    pieces: tuple[Piece, ...]


class Layout(Protocol):
    """A named layout convention (design §4): `megatron`, `vllm` or `hf`."""

    name: str

    def validate(self, manifest: Manifest, spec: ParallelSpec) -> None:
        """Raise LayoutError naming tensor, layout and constraint if the combination is unsupported."""
        ...

    def shard(self, manifest: Manifest, spec: ParallelSpec, coord: RankCoord) -> RankShard:
        """The local tensors and pieces of the rank at `coord`."""
        ...
