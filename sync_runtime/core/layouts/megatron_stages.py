"""Which global layers each (PP stage, VPP chunk) of a Megatron-Core model holds (layouts/megatron.py
docstring: PP/VPP), apart so the layout module stays one concern."""

from __future__ import annotations

from sync_runtime.core.topology import ParallelSpec, stage_layer_ranges
from sync_runtime.errors import LayoutError

NAME = "megatron"


def chunk_ranges(num_layers: int, spec: ParallelSpec) -> list[list[range]]:
    """Global layer range of every (stage, chunk): result[s][c] (see module docstring for PP/VPP)."""
    p, v = spec.pp, spec.vpp
    if spec.layer_counts is None and p <= num_layers and num_layers % (p * v) != 0:
        what = "pp" if v == 1 else "pp*vpp"
        raise LayoutError(
            f"{NAME}: {'pp' if v == 1 else 'vpp'}: L={num_layers} layers not divisible by "
            f"{what}={p * v} (Megatron splits evenly; for an uneven split give per-stage "
            "layer_counts, e.g. layers=8+7)"
        )
    if v == 1:
        return [[r] for r in stage_layer_ranges(num_layers, p, spec.layer_counts)]
    if spec.layer_counts is None:
        sizes = [num_layers // (p * v)] * p
    else:
        if sum(spec.layer_counts) != num_layers:
            raise LayoutError(f"{NAME}: layer_counts: sum {sum(spec.layer_counts)} != L={num_layers}")
        if any(c % v for c in spec.layer_counts):
            raise LayoutError(
                f"{NAME}: layer_counts: {list(spec.layer_counts)} must each be divisible by vpp={v}"
            )
        sizes = [c // v for c in spec.layer_counts]
    out: list[list[range]] = [[] for _ in range(p)]
    start = 0
    for b in range(p * v):
        s = b % p
        out[s].append(range(start, start + sizes[s]))
        start += sizes[s]
    return out
