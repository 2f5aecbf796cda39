"""Bucket messages: large transfers travel zero-copy, small ones packed with the checksums.

Message layout (both ends derive it from the Bucket and `direct_min_bytes`, so nothing about it
travels; the group agrees on `direct_min_bytes` together with the plan digest):
- every transfer of at least `direct_min_bytes` is its own message, its elements in row-major
  order. The sender sends straight from the source tensor when the region is contiguous there,
  the receiver receives straight into its staging when the region is contiguous there; only
  an end whose region is strided bounces through a pool buffer (one copy). Most regions are
  row ranges of contiguous tensors, so most bytes are never copied by the engine.
- then one tail message: the small transfers packed at 16-byte aligned offsets (one message
  instead of many tiny ones), then a header of one int64 checksum per transfer of the bucket.
Receiver checksums: a region received in place is checksummed in staging (catches a corrupted
message and a wrong placement); a strided region is checksummed in the bounce buffer it arrived
in, then copied (re-reading it from staging would cost a second copy); a small packed transfer
is checksummed in staging after the unpack, as before.

Dtypes: the wire carries every transfer's elements in its wire dtype (the manifest's, which is
the source's own; `wire` says it per transfer). A receiver whose staging holds the tensor in
another dtype casts once, on receipt: the message lands in a wire-dtype buffer (never in place:
staging has other bytes per element), its checksum is taken there over the wire bytes, then it
is copied into staging with `copy_` (the cast). A relay forwarding a tensor it stages in another
dtype casts it back to the wire dtype when packing (docs/dtypes.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sync_runtime.core.layouts.base import Box, box_shape
from sync_runtime.core.plan import Bucket, Transfer
from sync_runtime.transfer.checksum import checksum_bytes, checksum_tensor, raw_bytes
from sync_runtime.transfer.delta import max_message_bytes
from sync_runtime.transfer.delta_wire import DeltaIO, delta_direct_min

ALIGN = 16
TensorLookup = Callable[[str], torch.Tensor]
DtypeOf = Callable[[Transfer], torch.dtype]
"""The dtype a transfer's elements travel in."""


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class MessageLayout:
    """Which transfers of a bucket travel alone, and the tail's byte offsets."""

    direct: tuple[int, ...]
    """Indices of transfers sent as their own message, in this order, before the tail."""
    packed: tuple[int, ...]
    """Indices of transfers packed into the tail."""
    offsets: tuple[int, ...]
    """Byte offset of each packed transfer in the tail."""
    header_offset: int
    tail_nbytes: int

    @property
    def count(self) -> int:
        """Messages per bucket: the direct ones and the tail."""
        return len(self.direct) + 1


def message_layout(bucket: Bucket, direct_min_bytes: int) -> MessageLayout:
    direct, packed, offsets, pos = [], [], [], 0
    for i, t in enumerate(bucket.transfers):
        if t.nbytes >= max(direct_min_bytes, 1):
            direct.append(i)
            continue
        packed.append(i)
        offsets.append(pos)
        pos = _align(pos + t.nbytes)
    n = len(bucket.transfers)
    return MessageLayout(tuple(direct), tuple(packed), tuple(offsets), pos, pos + 8 * n)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (shares memory)."""
    return t.reshape(-1).view(torch.uint8)


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    return buf.view(dtype).view(shape)


def _get(pool: BufferPool | None, nbytes: int, device: torch.device) -> torch.Tensor:
    return pool.get(nbytes, device) if pool else torch.empty(nbytes, dtype=torch.uint8, device=device)


@dataclass(slots=True)
class Outgoing:
    """A bucket's messages in sending order (direct ones, then the tail)."""

    messages: list[torch.Tensor]
    pooled: list[bool]
    """True for buffers from the pool (give back after the send); False for source views."""

    @property
    def tail(self) -> torch.Tensor:
        return self.messages[-1]


def pack_bucket(
    bucket: Bucket,
    source: TensorLookup,
    device: torch.device,
    pool: BufferPool | None = None,
    direct_min_bytes: int = 0,
    wire: DtypeOf | None = None,
    delta: DeltaIO | None = None,
    emit: Callable[[torch.Tensor], None] | None = None,
) -> Outgoing:
    """Build a bucket's messages and write every transfer's checksum into the tail's header.

    A checksum is taken on the bytes as they will travel: the source region itself when it is
    contiguous, else the packed copy (the region's elements in row-major order either way).
    `wire`: the dtype each transfer travels in, where it may differ from the tensor's (a relay's
    staging); None: the tensors' own dtypes. `delta`: the sync's delta-format transfers
    (delta_wire.py); the checksum is then still the full new region's. `emit`: called with each
    direct message as soon as it is built, so it can go on the wire while the rest is packed (the
    tail, which carries every checksum, is built last).
    """
    in_delta = delta is not None and delta.applies(bucket.dst_rank)
    layout = message_layout(bucket, delta_direct_min(direct_min_bytes) if in_delta else direct_min_bytes)
    out = Outgoing([], [])
    sums = [0] * len(bucket.transfers)
    for i in layout.direct:
        t = bucket.transfers[i]
        region = source(t.src_name)[box_slices(t.src_box)]
        if in_delta:
            new = raw_bytes(region)
            sums[i] = checksum_bytes(new)
            out.messages.append(delta.encode(t, bucket.dst_rank, new, source(t.src_name)))  # type: ignore[union-attr]
            out.pooled.append(False)
            if emit is not None:
                emit(out.messages[-1])
            continue
        dtype = region.dtype if wire is None else wire(t)
        if region.is_contiguous() and region.device == device and region.dtype == dtype:
            msg, pooled = flat_bytes(region), False
        else:
            msg, pooled = _get(pool, t.nbytes, device), True
            _typed(msg, dtype, region.shape).copy_(region)
        sums[i] = checksum_bytes(msg)
        out.messages.append(msg)
        out.pooled.append(pooled)
        if emit is not None:
            emit(msg)
    tail = _get(pool, layout.tail_nbytes, device)
    for i, off in zip(layout.packed, layout.offsets, strict=True):
        t = bucket.transfers[i]
        src = source(t.src_name)
        piece = tail[off : off + t.nbytes]
        dtype = src.dtype if wire is None else wire(t)
        _typed(piece, dtype, box_shape(t.src_box)).copy_(src[box_slices(t.src_box)])
        sums[i] = checksum_bytes(piece)
    tail[layout.header_offset :].view(torch.int64).copy_(torch.tensor(sums, dtype=torch.int64))
    out.messages.append(tail)
    out.pooled.append(True)
    return out


@dataclass(slots=True)
class Incoming:
    """A bucket being received: one buffer per message, checksums as the messages land."""

    bucket: Bucket
    layout: MessageLayout
    messages: list[torch.Tensor]
    regions: list[torch.Tensor]
    """Staged region of each direct message (the message itself when received in place)."""
    pooled: list[bool]
    sums: list[int | None] = field(default_factory=list)
    landed: int = 0
    wire: list[torch.dtype | None] = field(default_factory=list)
    """Wire dtype of each transfer (None: the staged tensor's own, no cast)."""
    delta: DeltaIO | None = None
    """Set when the direct messages travel in the delta format (delta_wire.py)."""

    @property
    def complete(self) -> bool:
        return self.landed == len(self.messages)


def receive_bucket(
    bucket: Bucket,
    staged: TensorLookup,
    device: torch.device,
    pool: BufferPool,
    direct_min_bytes: int = 0,
    wire: DtypeOf | None = None,
    delta: DeltaIO | None = None,
) -> Incoming:
    """Receive buffers for a bucket: staging views where the staged region is contiguous and
    holds the wire dtype (`wire`: per transfer; None: every staged tensor holds it)."""
    in_delta = delta is not None and delta.applies(bucket.dst_rank)
    layout = message_layout(bucket, delta_direct_min(direct_min_bytes) if in_delta else direct_min_bytes)
    inc = Incoming(bucket, layout, [], [], [], [None] * len(bucket.transfers))
    inc.delta = delta if in_delta else None
    if wire is not None:
        for t in bucket.transfers:
            dtype = wire(t)
            inc.wire.append(None if dtype == staged(t.dst_name).dtype else dtype)
    for i in layout.direct:
        t = bucket.transfers[i]
        region = staged(t.dst_name)[box_slices(t.dst_box)]
        inc.regions.append(region)
        cast = wire is not None and inc.wire[i] is not None
        if inc.delta is not None:  # an upper bound: gloo lands a shorter message in it
            inc.messages.append(pool.get(max_message_bytes(t.nbytes), device))
            inc.pooled.append(True)
            continue
        in_place = region.is_contiguous() and region.device == device and not cast
        inc.messages.append(flat_bytes(region) if in_place else pool.get(t.nbytes, device))
        inc.pooled.append(not in_place)
    inc.messages.append(pool.get(layout.tail_nbytes, device))
    inc.pooled.append(True)
    return inc


def land(inc: Incoming, m: int, staged: TensorLookup) -> None:
    """Message `m` of the bucket arrived: checksum it and move it into staging."""
    inc.landed += 1
    layout, transfers = inc.layout, inc.bucket.transfers
    if m < len(layout.direct) and inc.delta is not None:
        i = layout.direct[m]
        region = inc.regions[m]
        if inc.delta.decode(transfers[i], inc.messages[m], region):  # else sums[i] stays None: bad
            inc.sums[i] = checksum_tensor(region)  # the rebuilt new region, in staging
        return
    if m < len(layout.direct):
        msg = inc.messages[m]
        inc.sums[layout.direct[m]] = checksum_bytes(msg)  # the wire bytes, before any cast
        if inc.pooled[m]:
            region = inc.regions[m]
            region.copy_(_typed(msg, _wire_of(inc, layout.direct[m]) or region.dtype, region.shape))
        return
    tail = inc.messages[m]
    for i, off in zip(layout.packed, layout.offsets, strict=True):
        t = transfers[i]
        dst = staged(t.dst_name)
        region = dst[box_slices(t.dst_box)]
        piece = tail[off : off + t.nbytes]
        cast = _wire_of(inc, i)
        if cast is None:
            region.copy_(_typed(piece, dst.dtype, box_shape(t.dst_box)))
            inc.sums[i] = checksum_tensor(region)  # in staging: also catches a wrong placement
        else:
            inc.sums[i] = checksum_bytes(piece)  # staging holds other bytes: check the wire's
            region.copy_(_typed(piece, cast, box_shape(t.dst_box)))


def _wire_of(inc: Incoming, i: int) -> torch.dtype | None:
    """The wire dtype of transfer `i` when it differs from its staging (a cast), else None."""
    return inc.wire[i] if inc.wire else None


def bad_transfers(inc: Incoming) -> list[Transfer]:
    """After every message landed: the transfers whose checksum differs from the sender's."""
    header = inc.messages[-1][inc.layout.header_offset :].view(torch.int64).tolist()
    return [t for t, got, want in zip(inc.bucket.transfers, inc.sums, header, strict=True) if got != want]


def unpack_bucket(
    bucket: Bucket,
    out: Outgoing,
    staged: TensorLookup,
    device: torch.device,
    direct_min_bytes: int = 0,
    wire: DtypeOf | None = None,
) -> list[Transfer]:
    """In-process round trip of `pack_bucket`'s messages into staging (tests); the bad transfers."""
    inc = receive_bucket(bucket, staged, device, BufferPool(), direct_min_bytes, wire)
    for m, (dst, src) in enumerate(zip(inc.messages, out.messages, strict=True)):
        dst.copy_(src)
        land(inc, m, staged)
    return bad_transfers(inc)


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
