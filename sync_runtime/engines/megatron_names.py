"""The tensors of a live Megatron-Core model, read from its modules (no checkpoint, no copies).

A rank's model is Megatron's list of chunks (one GPTModel per virtual-pipeline stage), possibly
wrapped in DDP / Float16Module. Names come from the unwrapped modules: parameters plus persistent
buffers (state_dict keys, e.g. `mlp.router.expert_bias`), without `_extra_state`. Each tensor
carries two names: the layout name (our `chunk{c}.` prefix when v > 1, Megatron's local layer
index j and local expert index k) and the global name (no prefix, global layer number
`layer_number - 1`, global expert id from `MoELayer.local_expert_indices`) that the converter
and the checks use. MTP layers (`GPTModel.mtp`, on the last chunk of the last stage) keep their
index i in `mtp.layers.{i}.`, their experts get global ids the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_BLOCK = re.compile(r"^(mtp\.layers\.(\d+)\.mtp_model_layer\.)(.*)$")
"""An MTP layer's decoder block (GPTModel.mtp, layouts/megatron_mtp.py): its index i stays as is."""
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


@dataclass(frozen=True, slots=True)
class LiveTensor:
    name: str
    """Name under the layout (what the participant reports)."""
    global_name: str
    """Chunk-free name with global layer and expert indices."""
    tensor: torch.Tensor
    """The live storage (a detached view: an optimizer step shows through)."""
    partition_dim: int | None
    """Megatron's TP split dim (None: every rank of its group holds it whole)."""
    partition_stride: int
    expert: bool
    """Split over the expert-TP group (routed experts) rather than the TP group."""


def unwrap(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Megatron's chunk list without DDP / Float16Module wrappers (megatron's own unwrap_model)."""
    from megatron.core.utils import unwrap_model

    chunks = list(model) if isinstance(model, Sequence) else [model]
    return [unwrap_model(m) for m in chunks]


def layer_numbers(chunk: torch.nn.Module) -> list[int]:
    """Global 0-based index of every local layer j: Megatron's 1-based `layer_number` - 1."""
    decoder = getattr(chunk, "decoder", None)
    return [int(layer.layer_number) - 1 for layer in (decoder.layers if decoder is not None else [])]


def expert_ids(chunk: torch.nn.Module) -> dict[int, list[int]]:
    """Global expert ids of every MoE layer's local experts, by local layer index j."""
    decoder = getattr(chunk, "decoder", None)
    return _local_expert_ids(decoder.layers if decoder is not None else [])


def mtp_expert_ids(chunk: torch.nn.Module) -> dict[int, list[int]]:
    """Global expert ids of every MoE MTP layer's local experts, by MTP layer index i."""
    block = getattr(chunk, "mtp", None)
    layers = block.layers if block is not None else []
    return _local_expert_ids([getattr(layer, "mtp_model_layer", None) for layer in layers])


def _local_expert_ids(layers: Sequence[torch.nn.Module | None]) -> dict[int, list[int]]:
    """By index in `layers`: the global ids of a MoE layer's local experts (its MLP's
    `local_expert_indices`); layers without experts are left out."""
    out: dict[int, list[int]] = {}
    for j, layer in enumerate(layers):
        ids = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
        if ids is not None:
            out[j] = [int(e) for e in ids]
    return out


def _global(prefix: str, rest: str, experts: list[int] | None) -> str:
    m = _LOCAL_EXPERT.match(rest)
    if m and experts is not None:
        return f"{prefix}mlp.experts.local_experts.{experts[int(m[1])]}.{m[2]}"
    m = _GROUPED_EXPERT.match(rest)
    if m and experts is not None:
        return f"{prefix}mlp.experts.{m[1]}.{m[2]}{experts[int(m[3])]}"
    return prefix + rest


def chunk_tensors(chunk: torch.nn.Module, prefix: str) -> list[LiveTensor]:
    """Parameters and persistent buffers of one unwrapped chunk, in state_dict order."""
    numbers, experts, mtp_experts = layer_numbers(chunk), expert_ids(chunk), mtp_expert_ids(chunk)
    out = []
    for name, value in chunk.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue  # TE/FP8 metadata, not a weight
        global_name = name
        if (m := _LAYER.match(name)) is not None:
            j = int(m[1])
            global_name = _global(f"decoder.layers.{numbers[j]}.", m[2], experts.get(j))
        elif (m := _MTP_BLOCK.match(name)) is not None:
            global_name = _global(m[1], m[3], mtp_experts.get(int(m[2])))
        dim = (
            getattr(value, "partition_dim", None) if getattr(value, "tensor_model_parallel", False) else None
        )
        out.append(
            LiveTensor(
                name=prefix + name,
                global_name=global_name,
                tensor=value.detach(),
                partition_dim=dim,
                partition_stride=int(getattr(value, "partition_stride", 1)),
                expert=".mlp.experts." in name,
            )
        )
    return out


def live_tensors(chunks: Sequence[torch.nn.Module]) -> list[LiveTensor]:
    """Every chunk's tensors; names carry `chunk{c}.` when there are several chunks (our convention)."""
    out = []
    for c, chunk in enumerate(chunks):
        out += chunk_tensors(chunk, f"chunk{c}." if len(chunks) > 1 else "")
    return out
