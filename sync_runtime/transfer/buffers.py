"""Bucket messages: one flat uint8 buffer per bucket, transfers packed in plan order.

Message layout (both ends derive it from the same Bucket, so nothing about it travels):
each transfer's bytes at a 16-byte aligned offset (so a slice can be viewed as any dtype),
then a header of one int64 checksum per transfer. One message per bucket keeps a bucket's
data and its checksums in a single send: no second matching, no ordering hazard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sync_runtime.layouts.base import Box, box_shape
from sync_runtime.plan import Bucket, Transfer
from sync_runtime.transfer.checksum import checksum_bytes, checksum_tensor

ALIGN = 16
TensorLookup = Callable[[str], torch.Tensor]


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class MessageLayout:
    """Byte offsets of a bucket's message."""

    offsets: tuple[int, ...]
    header_offset: int
    nbytes: int


def message_layout(bucket: Bucket) -> MessageLayout:
    offsets, pos = [], 0
    for t in bucket.transfers:
        offsets.append(pos)
        pos = _align(pos + t.nbytes)
    header = pos
    return MessageLayout(tuple(offsets), header, header + 8 * len(bucket.transfers))


def _region_view(buf: torch.Tensor, offset: int, t: Transfer, dtype: torch.dtype, box: Box) -> torch.Tensor:
    return buf[offset : offset + t.nbytes].view(dtype).view(box_shape(box))


def pack_bucket(
    bucket: Bucket, source: TensorLookup, device: torch.device, pool: BufferPool | None = None
) -> torch.Tensor:
    """Copy every transfer's source region into a fresh message buffer and append the checksums.

    The checksum is taken on the packed bytes: they are the source region's elements in
    row-major order, byte for byte, and already contiguous (no second copy of the region).
    """
    layout = message_layout(bucket)
    buf = (
        pool.get(layout.nbytes, device)
        if pool
        else torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    )
    sums = []
    for t, off in zip(bucket.transfers, layout.offsets, strict=True):
        src = source(t.src_name)
        _region_view(buf, off, t, src.dtype, t.src_box).copy_(src[box_slices(t.src_box)])
        sums.append(checksum_bytes(buf[off : off + t.nbytes]))
    header = buf[layout.header_offset :].view(torch.int64)
    header.copy_(torch.tensor(sums, dtype=torch.int64))
    return buf


def empty_message(bucket: Bucket, device: torch.device, pool: BufferPool) -> torch.Tensor:
    return pool.get(message_layout(bucket).nbytes, device)


def unpack_bucket(bucket: Bucket, buf: torch.Tensor, staged: TensorLookup) -> list[Transfer]:
    """Copy a received message into staging; return the transfers whose staged bytes fail the checksum.

    The receiver checksums the staged region after the copy (not the message), so a wrong
    unpack is caught as well as a corrupted message.
    """
    layout = message_layout(bucket)
    expected = buf[layout.header_offset :].view(torch.int64).tolist()
    bad = []
    for t, off, want in zip(bucket.transfers, layout.offsets, expected, strict=True):
        dst = staged(t.dst_name)
        region = dst[box_slices(t.dst_box)]
        region.copy_(_region_view(buf, off, t, dst.dtype, t.dst_box))
        if checksum_tensor(region) != want:
            bad.append(t)
    return bad


class BufferPool:
    """Message buffers kept across buckets, rounds and syncs (one pool per SyncGroup).

    A fresh multi-MB host buffer is page-faulted on first touch, which cost as much as the
    copy into it; on the warm path the plan and its bucket sizes repeat, so buffers are reused
    by exact size. Only buffers whose message completed come back, never ones a failed
    transfer may still write to. Free buffers are capped at `max_free_bytes`.
    """

    def __init__(self, max_free_bytes: int = 1 << 30) -> None:
        self._free: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self.max_free_bytes = max_free_bytes

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        stack = self._free.get((nbytes, device))
        if stack:
            self._free_bytes -= nbytes
            return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def put(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        if self._free_bytes + nbytes > self.max_free_bytes:
            return  # over the cap: let the allocator have it back
        self._free.setdefault((nbytes, buf.device), []).append(buf)
        self._free_bytes += nbytes

    def clear(self) -> None:
        self._free.clear()
        self._free_bytes = 0
