"""Delta syncs on one rank: the source's kept copy of what it last sent, and the delta-format
transfers of a sync (encoding: delta.py).

Which transfers travel in the delta format: every direct transfer (one of at least
`delta_direct_min(direct_min_bytes)`, its own message) to a destination rank listed in
`TransferConfig.delta_base` (rank -> the version every rank of its replica holds, as the
replicas themselves report it after recovery; the coordinator lists only such replicas).
Packed small transfers and the checksum header always travel whole. Every rank of the sync gets
the same list, and the group agrees on it together with the plan digest, so both ends derive the
same message layout.

A message in the delta format is self-describing (delta.py): the receiver posts a buffer of the
dense message's size (`max_message_bytes`, the transfer plus a 40-byte header: the same bound
as a full sync, so buffers stay within the planner's staging budget) and gloo delivers a shorter
message into it. The sender picks per transfer: a delta against its kept copy when that copy is
of the receiver's base version and the delta is smaller, else the dense message.

The receiver rebuilds the region in staging from its live copy of the base (never from staging:
staging is zeroed or holds a previous sync's bytes), then checksums the staged region: the
sender's checksum is of the full new region, so a receiver whose live bytes differ from the base
(corrupted, or another version under the same name) fails the sync's verification and nothing
is committed.

The kept copy: `KeptBits`, one host copy of the rank's whole shard, written only after a sync in
which every rank succeeded (until then it still holds the previous base; during the write it
holds no version). Host memory: the shard's bytes (docs/update-protocol.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from sync_runtime.core.layouts.base import Box
from sync_runtime.core.plan import Transfer
from sync_runtime.planner.digest import sync_digest
from sync_runtime.transfer import delta
from sync_runtime.transfer.checksum import raw_bytes
from sync_runtime.transfer.config import RankResult
from sync_runtime.transfer.spans import span

FORMAT = "delta1"
"""Version of the delta wire format; part of what the group agrees on."""
DELTA_DIRECT_MIN_BYTES = 16 * 1024
"""In a bucket to a delta rank, transfers from this size on travel as their own (delta) message:
a packed transfer travels whole, and regions of a few hundred KiB (a head group's rows of a QKV
weight) would otherwise send most of a model's bytes in full. Below it a 40-byte header and a
message's latency outweigh what a delta saves."""


def delta_direct_min(direct_min_bytes: int) -> int:
    """The direct-message threshold of a bucket to a delta rank (both ends derive it)."""
    return min(direct_min_bytes, DELTA_DIRECT_MIN_BYTES)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


class KeptBits:
    """A source rank's copy, in host memory, of the bits it sent in its last successful sync."""

    def __init__(self) -> None:
        self.version: str | None = None
        self._bits: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._bits.values())

    def base(self, name: str) -> torch.Tensor | None:
        return self._bits.get(name)

    def record(self, sources: Mapping[str, torch.Tensor], version: str) -> None:
        """Keep `sources` as sent for `version` (buffers are reused from sync to sync)."""
        self.version = None  # half-written: no version until every tensor is copied
        for name in set(self._bits) - set(sources):
            del self._bits[name]
        for name, t in sources.items():
            buf = self._bits.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                self._bits[name] = buf
            buf.copy_(t)
        self.version = version

    def clear(self) -> None:
        self.version = None
        self._bits = {}


@dataclass(slots=True)
class DeltaStats:
    """What one rank's delta-format sends came to."""

    transfers: int = 0
    delta_transfers: int = 0
    """Transfers sent as a delta (the others in the format went dense)."""
    nbytes: int = 0
    """Bytes of those transfers in full."""
    wire_bytes: int = 0
    """Bytes of their messages."""
    elements: int = 0
    changed: int = 0
    """Elements compared against a base, and how many of them changed."""


def agreed(plan_digest: str, direct_min_bytes: int, base_for: Mapping[int, str]) -> str:
    """What the group agrees on before the first byte: the plan digest extended with the sync's
    encoding (planner.digest.sync_digest: the format and every delta rank's base)."""
    return sync_digest(plan_digest, direct_min_bytes, FORMAT, base_for)


@dataclass(slots=True)
class DeltaIO:
    """One rank's delta-format transfers of one sync (both ends)."""

    base_for: Mapping[int, str]
    kept: KeptBits | None = None
    """Source: the kept copy (None: this rank keeps none, it sends dense messages)."""
    live: Mapping[str, torch.Tensor] | None = None
    """Destination: its live tensors, the base it rebuilds from."""
    stats: DeltaStats = field(default_factory=DeltaStats)

    def applies(self, dst_rank: int) -> bool:
        return dst_rank in self.base_for

    @span("transfer.delta_encode")
    def encode(self, t: Transfer, dst_rank: int, new: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The message for transfer `t` of tensor `source` whose new bytes are `new` (flat uint8).
        Dense unless the kept copy is of the receiver's base and of the same shape and dtype (a
        source whose layout changed keeps tensors of the same names in other shapes)."""
        word = delta.word_size(source.element_size())
        new_np = new.cpu().numpy()
        kept = self.kept
        base = kept.base(t.src_name) if kept is not None and kept.version == self.base_for[dst_rank] else None
        if base is not None and (base.shape != source.shape or base.dtype != source.dtype):
            base = None
        if base is not None:
            enc = delta.encode(raw_bytes(base[_slices(t.src_box)]).numpy(), new_np, word)
            self.stats.elements += enc.elements
            self.stats.changed += enc.changed
        else:
            enc = delta.encode_dense(new_np, word)
        self.stats.transfers += 1
        self.stats.delta_transfers += enc.kind == delta.DELTA
        self.stats.nbytes += new_np.size
        self.stats.wire_bytes += enc.nbytes
        return torch.from_numpy(enc.message)

    @span("transfer.delta_decode")
    def decode(self, t: Transfer, message: torch.Tensor, region: torch.Tensor) -> bool:
        """Rebuild `region` (staging) from the live base and `message`; False for a message that
        does not fit the base (the caller fails the transfer's checksum)."""
        assert self.live is not None
        base = raw_bytes(self.live[t.dst_name][_slices(t.dst_box)].cpu()).numpy()
        in_place = region.is_contiguous() and region.device.type == "cpu"
        out = region.reshape(-1).view(torch.uint8).numpy() if in_place else np.empty_like(base)
        try:
            delta.decode(message.numpy(), base, out)
        except delta.DeltaFormatError:
            return False
        if not in_place:
            region.copy_(torch.from_numpy(out).view(region.dtype).view(region.shape))
        return True


def account(result: RankResult, io: DeltaIO | None) -> RankResult:
    """Fill a successful rank's wire bytes and delta counts."""
    result.wire_bytes = result.send_bytes
    if io is not None:  # the delta-format messages replace their transfers' full bytes
        st = io.stats
        result.wire_bytes += st.wire_bytes - st.nbytes
        result.delta_transfers, result.dense_transfers = st.delta_transfers, st.transfers - st.delta_transfers
        result.delta_elements, result.delta_changed = st.elements, st.changed
    return result


def kept_after(
    kept: KeptBits | None, keep: bool, ok: bool, sources: Mapping[str, torch.Tensor] | None, version: str
) -> KeptBits | None:
    """A source's kept copy after a sync: none when it keeps none (delta off: freed); the bits it
    sent after a sync every rank finished (the fence held: they are what went out)."""
    if not keep:
        return None
    if ok and sources is not None:
        kept = kept or KeptBits()
        kept.record(sources, version)
    return kept


def delta_io(base: tuple[tuple[int, str], ...], kept: KeptBits | None, destination: object) -> DeltaIO | None:
    """A rank's DeltaIO for a sync with these delta bases (None: a full sync)."""
    live = getattr(destination, "delta_base", None)  # an engine's own copy (vLLM: tensors are metadata)
    if live is None:
        live = getattr(destination, "tensors", None)
    return DeltaIO(dict(base), kept, live) if base else None
