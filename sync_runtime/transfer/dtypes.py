"""Which dtype each transfer travels in on one rank, and where the receiving rank casts.

The wire dtype of a canonical tensor is the manifest's, which is the source's own (discovery
refuses a source holding it in another dtype), so a sender sends its tensor's bytes unchanged and
the plan sizes every transfer from the manifest. A destination rank may hold the tensor in
another float dtype: the runtime then hands it `TransferConfig.wire_dtypes` (canonical tensor ->
wire dtype) with its program, and the rank casts on receipt (buffers.py). Without an entry the
wire dtype is the one the rank reported for the tensor (`Staging.tensors`), which its staging
buffer may still widen (a vLLM rank stages an fp32 parameter whose checkpoint dtype is bf16).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sync_runtime.core.plan import Transfer
from sync_runtime.transfer.staging import Staging


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class WireDtypes:
    """The dtype every transfer of one rank travels in (a rank's `sources` are the manifest's)."""

    __slots__ = ("_casts", "_destination", "_sources")

    def __init__(
        self,
        wire_dtypes: tuple[tuple[str, str], ...] | Mapping[str, str],
        sources: Mapping[str, torch.Tensor] | None,
        destination: Staging | None,
    ) -> None:
        pairs = wire_dtypes.items() if isinstance(wire_dtypes, Mapping) else wire_dtypes
        self._casts = {name: torch_dtype(dtype) for name, dtype in pairs}
        self._sources = sources
        self._destination = destination

    @property
    def casts(self) -> dict[str, torch.dtype]:
        """Canonical tensor -> wire dtype, where this destination rank holds another dtype."""
        return dict(self._casts)

    def recv(self, t: Transfer) -> torch.dtype:
        """The dtype `t`'s bytes arrive in."""
        cast = self._casts.get(t.tensor)
        if cast is not None:
            return cast
        assert self._destination is not None
        return self._destination.tensors[t.dst_name].dtype

    def send(self, t: Transfer) -> torch.dtype:
        """The dtype `t`'s bytes leave in: a source tensor's own; a relayed one's wire dtype."""
        if self._sources is not None and t.src_name in self._sources:
            return self._sources[t.src_name].dtype
        cast = self._casts.get(t.tensor)
        if cast is not None:
            return cast
        assert self._destination is not None
        return self._destination.tensors[t.src_name].dtype
