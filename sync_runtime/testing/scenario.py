"""A sync scenario run on local rank processes: plan it, build each rank's tensors, run, check.

Shared by the engine's tests and `bench/transfer_bench.py`; nothing here runs in production.
Canonical tensors are the seeded weights of `testing.weights` (a pure function of seed, version
and tensor name), so every rank process builds the same ones without shipping bytes; a
destination checks its committed tensors bit for bit against `layouts.materialize(dst_shard,
canon)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.base import RankShard
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.weights import reference_weights

_SIGNED = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32, np.dtype(np.uint8): np.uint8}
SCENARIO_VERSION = "v1"
"""The weights version a scenario's `seed` stands for (versions only matter to the demo's actors)."""
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class Scenario:
    """A model, both sides' layouts and parallelism, and planner settings. Picklable."""

    model: str | dict[str, Any]
    """Preset name or a config.json dict."""
    source: str
    destination: str
    source_layout: str = "megatron"
    destination_layout: str = "vllm"
    planner: dict[str, Any] = field(default_factory=dict)
    """PlannerConfig keyword arguments."""

    def manifest(self) -> Manifest:
        config = load_model_config(self.model) if isinstance(self.model, str) else self.model
        return build_manifest(config)

    def sides(self) -> tuple[SideSpec, SideSpec]:
        src, dst = ParallelSpec.parse(self.source), ParallelSpec.parse(self.destination)
        return (
            SideSpec(self.source_layout, src, tuple(enumerate_ranks(src, Role.SOURCE))),
            SideSpec(self.destination_layout, dst, tuple(enumerate_ranks(dst, Role.DESTINATION))),
        )

    def plan(self) -> SyncPlan:
        source, destination = self.sides()
        return plan_sync(self.manifest(), source, [destination], PlannerConfig(**self.planner))

    def shard(self, rank: int) -> tuple[Role, RankShard]:
        """The role and layout shard of global rank `rank` (sources first, then destinations)."""
        source, destination = self.sides()
        manifest = self.manifest()
        if rank < len(source.coords):
            return Role.SOURCE, get_layout(source.layout).shard(manifest, source.spec, source.coords[rank])
        coord = destination.coords[rank - len(source.coords)]
        return Role.DESTINATION, get_layout(destination.layout).shard(manifest, destination.spec, coord)

    @property
    def world_size(self) -> int:
        source, destination = self.sides()
        return len(source.coords) + len(destination.coords)


def canonical(
    manifest: Manifest, seed: int, names: set[str] | None = None, version: str = SCENARIO_VERSION
) -> dict[str, np.ndarray]:
    """The seeded bf16 canonical tensors as uint16 bits: the one generator the demo, the serving
    checker and the engine tests use too (`testing.weights`), so a scenario's bytes are the demo's."""
    return reference_weights(manifest, seed, version, names)


def to_torch(local: dict[str, np.ndarray], shard: RankShard) -> dict[str, torch.Tensor]:
    """numpy bit arrays (uint16 for bf16) -> torch tensors of the shard's dtypes, same bytes."""
    dtypes = {t.name: _TORCH_DTYPES[t.dtype] for t in shard.tensors}
    # torch has no uint16/uint32 from_numpy; the signed view has the same bytes.
    return {name: torch.from_numpy(a.view(_SIGNED[a.dtype])).view(dtypes[name]) for name, a in local.items()}


def rank_tensors(shard: RankShard, manifest: Manifest, seed: int) -> dict[str, torch.Tensor]:
    """This rank's local tensors for canonical weights `seed`."""
    canon = canonical(manifest, seed, {p.tensor for p in shard.pieces})
    return to_torch(materialize(shard, canon), shard)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def mismatches(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names of local tensors whose bytes differ from the expected ones."""
    return [n for n, w in want.items() if not torch.equal(bits(live[n]), bits(w))]
