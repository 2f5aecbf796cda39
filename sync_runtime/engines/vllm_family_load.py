"""What vLLM's loader does to a family's checkpoint tensors beyond cutting them, in one place.

A layout piece maps a box of a canonical tensor onto a box of a local one element for element, in
row-major order: it narrows and places, it cannot transpose, and it cannot write a value the
checkpoint does not hold. vLLM 0.32's loader does both for gpt-oss (`GptOssModel.
_load_weights_other`, the unquantized path), so a vLLM rank of that family receives those tensors
as the checkpoint holds them and the apply does the rest, as the loader would:

- The narrowed expert weights are permuted: gate_up (E', H, 2n) -> `w13_weight` (E', 2n, H) and
  down (E', n, H) -> `w2_weight` (E', H, n) (gate/up interleaving kept). The `vllm` layout declares
  them in the checkpoint's orientation (`layouts/fused_experts.PERMUTED_LOCALS`); the rank reports
  that shape to discovery (`received_shape`) and the apply permutes on copy (`to_param`).
- `w2_bias` is zeroed on MoE TP ranks > 0 (the row-parallel reduction adds it once): those ranks
  receive no piece of it, do not report it, and the apply zeroes it (`zeroed`).

No other family is touched: the tables are keyed by the model's `model_type`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sync_runtime.core.layouts.fused_experts import PERMUTED_LOCALS

PERMUTED: dict[str, Mapping[str, tuple[int, ...]]] = {"gpt_oss": PERMUTED_LOCALS}
"""model_type -> {parameter name in its module: the permutation vLLM's loader applies to the
received (checkpoint-oriented) tensor to give the parameter}."""
ZEROED_OFF_TP_RANK0: dict[str, frozenset[str]] = {"gpt_oss": frozenset({"w2_bias"})}
"""model_type -> MoE parameters vLLM's loader zeroes on MoE TP ranks > 0."""


def model_type(model: torch.nn.Module) -> str:
    """The Hugging Face `model_type` of a vLLM model ("" when it holds no HF config)."""
    return str(getattr(getattr(model, "config", None), "model_type", "") or "")


def received_shape(family: str, pname: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a rank receives for a parameter of `shape`: the inverse of the loader's permutation."""
    perm = PERMUTED.get(family, {}).get(pname)
    if perm is None:
        return shape
    return tuple(shape[perm.index(i)] for i in range(len(perm)))


def to_param(family: str, pname: str, received: torch.Tensor) -> torch.Tensor:
    """The received tensor as the parameter holds it (a view; the caller copies it)."""
    perm = PERMUTED.get(family, {}).get(pname)
    return received if perm is None else received.permute(*perm)


def zeroed(family: str, module: torch.nn.Module) -> frozenset[str]:
    """Parameters of `module` that vLLM's loader zeroes on this rank: never received."""
    names = ZEROED_OFF_TP_RANK0.get(family)
    moe_config = getattr(module, "moe_config", None)
    if not names or moe_config is None or moe_config.moe_parallel_config.tp_rank == 0:
        return frozenset()
    return frozenset(n for n in names if getattr(module, n, None) is not None)
