"""The demo's participants: Ray actors that hold synthetic shards under a layout's names.

Real engines take part through `sync_runtime.engines`; these stand in for them where no engine
runs (the default demo, most tests, the e2e suite)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.runtime.participant import WeightSyncParticipant


class MegatronSourceActor(WeightSyncParticipant):
    """A source rank holding Megatron-named shards (design §4.2). Wrap with `ray.remote`."""

    def __init__(
        self,
        coord: RankCoord,
        tensors: Mapping[str, torch.Tensor],
        *,
        version: str | None = None,
        model_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.ws_init(
            role=Role.SOURCE,
            coord=coord,
            layout="megatron",
            tensors=tensors,
            version=version,
            model_config=model_config,
        )

    def ws_update(self, tensors: Mapping[str, torch.Tensor], version: str) -> None:
        """A training step happened: copy new values into the live tensors (same names/shapes)."""
        st = self._ws_state()
        for name, value in tensors.items():
            st.tensors[name].copy_(value)
        st.version = version


class VllmDestinationActor(WeightSyncParticipant):
    """A destination rank holding vLLM-named shards (design §4.1) in `DestinationWeights`."""

    def __init__(
        self, coord: RankCoord, tensors: Mapping[str, torch.Tensor], *, version: str | None = None
    ) -> None:
        self.ws_init(role=Role.DESTINATION, coord=coord, layout="vllm", tensors=tensors, version=version)
