"""Seeded weights and the demo's participant actors, shared by `weightsync demo`, tests and e2e.

Weights are a pure function of (seed, version, tensor name): any process (a source actor that
"trains a step", the checker of an end-to-end test) recomputes exactly the same bf16 (or, for
F32 tensors, float32) bits without moving them. Each actor generates only the canonical tensors
its own pieces touch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.manifest import Manifest, TensorMeta
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import tensor_sha256
from sync_runtime.testing.actors import MegatronSourceActor, VllmDestinationActor

INIT_STD = 0.02
"""Scale of the random weights (like an initialised transformer): keeps every bf16 value finite."""


def model_config(model: str | Mapping[str, Any]) -> dict[str, Any]:
    """A preset name, a config.json path, or an already loaded config dict."""
    return dict(model) if isinstance(model, Mapping) else load_model_config(model)


def tensor_seed(seed: int, version: str, name: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{version}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, as torch does."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def canonical_tensor(meta: TensorMeta, seed: int, version: str) -> np.ndarray:
    """The canonical tensor `meta.name` of weights version `version`: uint16 bf16 bits, or uint32
    float32 bits for the tensors a checkpoint stores in F32 (router biases)."""
    if meta.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"{meta.name}: demo weights are bfloat16 or float32, manifest says {meta.dtype}")
    rng = np.random.default_rng(tensor_seed(seed, version, meta.name))
    values = rng.standard_normal(meta.shape, dtype=np.float32) * np.float32(INIT_STD)
    return to_bf16_bits(values) if meta.dtype == "bfloat16" else values.view(np.uint32)


def reference_weights(
    manifest: Manifest, seed: int, version: str, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    wanted = set(names) if names is not None else None
    return {
        t.name: canonical_tensor(t, seed, version)
        for t in manifest.tensors
        if wanted is None or t.name in wanted
    }


def shard_arrays(
    manifest: Manifest,
    layout: str,
    spec: ParallelSpec,
    coord: RankCoord,
    seed: int,
    version: str,
) -> dict[str, np.ndarray]:
    """The local tensors (uint16 bits) of the rank at `coord` for weights (seed, version)."""
    shard = get_layout(layout).shard(manifest, spec, coord)
    canon = reference_weights(manifest, seed, version, names={p.tensor for p in shard.pieces})
    return materialize(shard, canon)


def expected_sha256(
    manifest: Manifest,
    layout: str,
    spec: ParallelSpec,
    coord: RankCoord,
    seed: int,
    version: str,
) -> dict[str, str]:
    """sha256 of every local tensor the rank must hold: what `ws_sha256` must return."""
    arrays = shard_arrays(manifest, layout, spec, coord, seed, version)
    return {name: tensor_sha256(bits_to_torch(a)) for name, a in arrays.items()}


def bits_to_torch(bits: np.ndarray) -> torch.Tensor:
    """uint16 (uint32) bit patterns -> a bf16 (float32) torch tensor with the same bits (a copy)."""
    dtype = torch.float32 if bits.dtype.itemsize == 4 else torch.bfloat16
    return torch.from_numpy(np.ascontiguousarray(bits)).view(dtype).clone()


def torch_to_bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.element_size() == 4:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.view(torch.uint16).numpy()


def _tensors(
    manifest: Manifest,
    layout: str,
    spec: ParallelSpec,
    coord: RankCoord,
    seed: int,
    version: str,
) -> dict[str, torch.Tensor]:
    return {
        n: bits_to_torch(a) for n, a in shard_arrays(manifest, layout, spec, coord, seed, version).items()
    }


class DemoSource(MegatronSourceActor):
    """A Megatron-layout source rank whose weights are the seeded weights of a version."""

    def __init__(
        self, model: str | Mapping[str, Any], spec: ParallelSpec, coord: RankCoord, seed: int, version: str
    ) -> None:
        torch.set_num_threads(1)  # many ranks share few cores; one thread each avoids thrashing
        config = model_config(model)
        self._manifest, self._spec = build_manifest(config), spec
        tensors = _tensors(self._manifest, "megatron", spec, coord, seed, version)
        super().__init__(coord, tensors, version=version, model_config=config)

    def ws_set_version_weights(self, seed: int, version: str) -> str:
        """ "Train a step": the live tensors become the seeded weights of `version` (in place)."""
        coord = self._ws_state().coord
        self.ws_update(_tensors(self._manifest, "megatron", self._spec, coord, seed, version), version)
        return version


class DemoDestination(VllmDestinationActor):
    """A vLLM-layout destination rank starting with the seeded weights of an older version."""

    def __init__(
        self, model: str | Mapping[str, Any], spec: ParallelSpec, coord: RankCoord, seed: int, version: str
    ) -> None:
        torch.set_num_threads(1)
        manifest = build_manifest(model_config(model))
        super().__init__(coord, _tensors(manifest, "vllm", spec, coord, seed, version), version=version)
