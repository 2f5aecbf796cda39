"""Sparse "training steps" that a checkpoint reproduces exactly, for delta syncs into real engines.

An RL optimizer step moves a few percent of the bf16 elements by an ulp or so. To compare an
engine that took such steps as deltas with one loaded from a checkpoint of the same version,
the step must be computable on a source's shards and on the canonical tensors alike. Here it is
a function of each element's own bits (and the step number), never of its position: layouts
only move elements (slices, concatenations, interleaves; no arithmetic), so stepping a shard
and stepping the canonical tensor before sharding give the same bits. A step flips the lowest
mantissa bit (one ulp) of the elements whose bit pattern hashes below `fraction`; equal values
change together, so the changed fraction is close to, not exactly, `fraction`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sync_runtime.core.manifest import Manifest
from sync_runtime.testing.weights import DemoSource, bits_to_torch, reference_weights

MULTIPLIER = np.uint32(2654435761)  # Knuth's multiplicative hash: spreads nearby patterns apart


def step_mask(bits: np.ndarray, step: int, fraction: float) -> np.ndarray:
    """Which elements step `step` changes: a bool array shaped like `bits` (uint16 or uint32)."""
    salted = bits.astype(np.uint32) ^ np.uint32((step * 0x9E3779B9) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        hashed = (salted * MULTIPLIER) >> np.uint32(16)
    return (hashed & np.uint32(0xFFFF)) < np.uint32(round(fraction * 65536))


def step_bits(bits: np.ndarray, step: int, fraction: float) -> np.ndarray:
    """`bits` after step `step` (a new array)."""
    return bits ^ step_mask(bits, step, fraction).astype(bits.dtype)


def stepped_weights(manifest: Manifest, seed: int, version: str, steps: int, fraction: float) -> dict:
    """The canonical tensors (bits) of the demo's weights (seed, version) after steps 1..steps."""
    weights = reference_weights(manifest, seed, version)
    for k in range(1, steps + 1):
        weights = {n: step_bits(a, k, fraction) for n, a in weights.items()}
    return weights


def write_stepped_model(directory: Path, config: Mapping[str, Any], weights: Mapping[str, np.ndarray]) -> str:
    """An HF model dir (config.json + model.safetensors) holding `weights` (canonical bits)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config)))
    save_file({n: bits_to_torch(a) for n, a in weights.items()}, str(directory / "model.safetensors"))
    return str(directory)


def _bits_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a numpy array sharing its memory (contiguous CPU tensors only)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("a sparse step writes contiguous CPU tensors in place")
    if t.element_size() == 4:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


class SteppedSource(DemoSource):
    """A demo source rank that can take sparse steps in place (wrap with `ray.remote`)."""

    def ws_sparse_step(self, step: int, fraction: float, version: str) -> int:
        """Step `step` on every local tensor; returns how many elements changed."""
        st = self._ws_state()
        changed = 0
        for t in st.tensors.values():
            bits = _bits_view(t).reshape(-1)
            mask = step_mask(bits, step, fraction)
            bits ^= mask.astype(bits.dtype)
            changed += int(mask.sum())
        st.version = version
        return changed
