"""A vLLM rank's base for delta syncs: a host copy of the shard it last committed.

A vLLM rank's live weights are in kernel layouts (CPU linears repacked, experts prepacked): they
are not the bytes a delta is computed against, so a delta cannot be rebuilt from them. What the
rank can keep is what it received: the staged buffers of its last commit, in the per-rank
shapes and dtypes of the wire (vLLM's pre-load metadata), which the apply only reads. After a
successful commit `VllmStaging` keeps them as `CommittedBase` instead of freeing them; the next
sync's staging is fresh buffers, and the receiver rebuilds every delta-format region into them
from this copy (transfer/delta_wire.py, `DeltaIO.decode`). The checksum of the full new region
is checked as always before the commit: a base that is not the bytes of the version it is
recorded for fails the sync, which the coordinator redoes in full in the same run.

A rank reports it holds a base (`ParticipantMeta.live_base`) only when the copy is of the
version it committed and serves, the replica is not poisoned, and no tensor is staged in
another dtype than its wire's (vLLM's fp32 `e_score_correction_bias` from a bf16 checkpoint:
the delta and its checksum are of wire bytes, staging holds widened ones). Otherwise, and after
an engine restart (no copy), the coordinator lists none of its replica's ranks for deltas: the
replica takes that sync in full, in the same run as the others' deltas.

Host memory: the rank's shard once between syncs (bf16: 2 bytes per local parameter), twice
during a sync (the base plus the new staging). It is kept as the base only while
spec.transport.delta is `auto` on the gloo backend (`TransferConfig.keep_sent`); with `off`
(or NCCL) the next sync drops it at its start, and a full sync's commit keeps its staged
buffers instead, as the next full sync's staging (the shard once between syncs either way).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch


class CommittedBase:
    """The staged buffers of a rank's last commit, and the version they hold."""

    def __init__(self) -> None:
        self.version: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    @property
    def tensors(self) -> MappingProxyType[str, torch.Tensor]:
        return MappingProxyType(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def keep(self, staged: Mapping[str, torch.Tensor], version: str) -> None:
        """Keep the buffers `version` was committed from (no copy: nothing writes them again)."""
        self._tensors, self.version = dict(staged), version

    def drop(self) -> None:
        self._tensors, self.version = {}, None

    def holds(self, version: str) -> bool:
        return bool(version) and self.version == version and bool(self._tensors)


def widened(meta: Mapping[str, torch.Tensor], staging_dtype: Mapping[str, torch.dtype]) -> tuple[str, ...]:
    """Tensors staged in another dtype than their wire's: a rank holding any takes no deltas."""
    return tuple(sorted(n for n, t in meta.items() if staging_dtype[n] != t.dtype))
