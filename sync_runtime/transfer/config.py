"""Runtime settings and per-rank results of the transfer engine (its errors: `sync_runtime.errors`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sync_runtime.errors import SyncFailure

BackendName = Literal["gloo", "nccl"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """How one rank executes its part of a plan."""

    backend: BackendName = "gloo"
    """Process-group backend: gloo for CPU tensors, nccl for CUDA tensors."""
    timeout_s: float = 60.0
    """Limit of every blocking step (one round's messages, the store handshakes, the final agreement)."""
    device: str = "cpu"
    """Where staging and bucket buffers live ("cuda:N" for NCCL, whose messages must be on the GPU)."""
    poll_interval_s: float = 0.1
    """How often a waiting rank looks for a peer's failure flag in the store."""
    direct_min_bytes: int = 256 * 1024
    """Transfers at least this large travel as their own message, sent from the source tensor and
    received into staging without a copy where the region is contiguous; smaller ones are packed
    into one message per bucket (fewer, larger messages). Part of the message format: every rank
    of a sync must use the same value (checked with the plan digest)."""
    staging: str = "host"
    """Destination staging policy (`host`, `device`, `inplace`; see staging.py)."""
    snapshot: bool = False
    """Source: copy the shards to host memory first, so the trainer may step during the sync."""
    wire_dtypes: tuple[tuple[str, str], ...] = ()
    """Destination: (canonical tensor, wire dtype) for each tensor this rank holds in another dtype
    than the one it travels in (the manifest's, i.e. the source's). The rank receives those bytes
    into a wire-dtype buffer, verifies their checksum, and casts once into its staging. Filled by
    the runtime from discovery (runtime/discovery.py); empty when every dtype agrees. Local to the
    receiver: senders and the plan never see it (docs/dtypes.md)."""
    delta_base: tuple[tuple[int, str], ...] = ()
    """(destination rank, base version) for every rank whose replica holds that version on all
    its ranks: its direct transfers travel in the delta format (delta_wire.py). The same on every
    rank of a sync (the group agrees on it); empty: a full sync. gloo only: NCCL needs equal
    message sizes at both ends."""
    keep_sent: bool = False
    """Source: keep a host copy of what a successful sync sent, the base of the next deltas."""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r}: must be 'gloo' or 'nccl'")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0")
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"backend=nccl needs a CUDA device, got device={self.device!r}")
        if not 0 < self.poll_interval_s <= self.timeout_s:
            raise ValueError(f"poll_interval_s={self.poll_interval_s}: must be in (0, timeout_s]")
        if self.staging not in ("host", "device", "inplace"):
            raise ValueError(f"staging={self.staging!r}: must be 'host', 'device' or 'inplace'")
        if self.delta_base and self.backend != "gloo":
            raise ValueError("delta_base: delta syncs need the gloo backend")
        if self.direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes={self.direct_min_bytes}: must be >= 0")


@dataclass(slots=True)
class RankResult:
    """What one rank did in one sync. `ok=False` carries the failure: its reason, rank, step and,
    where known, the peer and the tensor."""

    rank: int
    ok: bool
    send_bytes: int
    recv_bytes: int
    seconds: float
    failure: SyncFailure | None = None
    wire_bytes: int = 0
    """Payload bytes this rank sent (send_bytes in full; less where deltas went instead)."""
    delta_transfers: int = 0
    dense_transfers: int = 0
    """Transfers this rank sent in the delta format as deltas, and dense (no base, or no gain)."""
    delta_elements: int = 0
    delta_changed: int = 0
    """Elements compared against the kept base, and how many of them changed."""
