"""Runtime settings, per-rank results and errors of the transfer engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r}: must be 'gloo' or 'nccl'")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0")
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"backend=nccl needs a CUDA device, got device={self.device!r}")
        if not 0 < self.poll_interval_s <= self.timeout_s:
            raise ValueError(f"poll_interval_s={self.poll_interval_s}: must be in (0, timeout_s]")
        if self.direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes={self.direct_min_bytes}: must be >= 0")


@dataclass(slots=True)
class RankResult:
    """What one rank did in one sync. `ok=False` carries an error naming rank, round, peer and step."""

    rank: int
    ok: bool
    send_bytes: int
    recv_bytes: int
    seconds: float
    error: str | None = None
    step: str | None = None
    """SyncStep value of the failure: "plan" (plan/tensor mismatch), "transfer" or "verify" (checksum)."""


class TransferError(RuntimeError):
    """A failure while executing a plan; the message names rank, round, peer and step."""

    def __init__(self, message: str, *, step: str = "transfer") -> None:
        super().__init__(message)
        self.step = step


class PlanMismatchError(ValueError):
    """The plan does not fit this rank's tensors; the message names rank, tensor, box and shape."""


class StagingError(RuntimeError):
    """DestinationWeights used out of order (commit without begin, unknown tensor)."""
