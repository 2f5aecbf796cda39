"""An HF-layout (FSDP-style) demo source rank: canonical tensor names, TP-sharded unfused tensors
(layouts/hf.py). The source for families no Megatron-Core layer spec holds (Gemma 3's sandwich
norms), whose trainers keep the Hugging Face module tree. Its weights are the demo's seeded
weights of (seed, version), like `DemoSource`'s; a separate module so Ray workers import it by
name (a test module is not importable there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import WeightSyncParticipant
from sync_runtime.testing.weights import bits_to_torch, model_config, shard_arrays

LAYOUT = "hf"


class HfDemoSource(WeightSyncParticipant):
    """Built like `DemoSource` (model, spec, coord, seed, version); `create_participants` takes it
    as `source_class`."""

    def __init__(
        self, model: str | Mapping[str, Any], spec: ParallelSpec, coord: RankCoord, seed: int, version: str
    ) -> None:
        torch.set_num_threads(1)  # many ranks share few cores; one thread each avoids thrashing
        config = model_config(model)
        # With the MTP part where the model has one (a destination serving MTP is sent it from here).
        self._manifest, self._spec = build_manifest(config).with_mtp(), spec
        self.ws_init(
            role=Role.SOURCE,
            coord=coord,
            layout=LAYOUT,
            tensors=self._tensors(coord, seed, version),
            version=version,
            model_config=config,
        )

    def _tensors(self, coord: RankCoord, seed: int, version: str) -> dict[str, torch.Tensor]:
        arrays = shard_arrays(self._manifest, LAYOUT, self._spec, coord, seed, version)
        return {n: bits_to_torch(a) for n, a in arrays.items()}

    def ws_set_version_weights(self, seed: int, version: str) -> str:
        """ "Train a step": the live tensors become the seeded weights of `version` (in place)."""
        st = self._ws_state()
        for name, value in self._tensors(st.coord, seed, version).items():
            st.tensors[name].copy_(value)
        st.version = version
        return version

    def scramble(self, name: str) -> None:
        """Negative controls: every value of local tensor `name` changes (+1, exact in bf16 at
        these magnitudes), in place, the version label kept."""
        with torch.no_grad():
            self._ws_state().tensors[name].add_(1.0)
