"""The apply's handling of kernel tensors another module released, without an engine.

On AMX CPUs vLLM's MLA attention packs W_UK/W_UV from `kv_b_proj.weight` and then replaces that
weight with `torch.empty(0)`; re-processing `kv_b_proj` yields its full weight again. The apply
keeps that processed weight live (the attention layer re-reads and releases it at finalize), and
refuses any other shape change by name. Engine environment (the module's neighbours import vLLM).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sync_runtime.engines.vllm_apply import _adopt_released_kernel_tensors
from sync_runtime.errors import DestinationError

pytestmark = [pytest.mark.engines, pytest.mark.vllm]


def _layer(weight: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    return layer


def _info(kernel: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(kernel_tensors=({"weight": torch.nn.Parameter(kernel, requires_grad=False)}, {}))


def test_a_released_placeholder_gives_way_to_the_processed_weight() -> None:
    processed = torch.arange(16, dtype=torch.bfloat16).reshape(4, 4)
    layer, info = _layer(processed), _info(torch.empty(0))
    _adopt_released_kernel_tensors(layer, info, "kv_b_proj")
    assert info.kernel_tensors[0]["weight"] is layer.weight
    assert torch.equal(info.kernel_tensors[0]["weight"], processed)


def test_an_equal_shape_keeps_the_live_kernel_tensor() -> None:
    """Linears whose own processing empties the weight ([0] again) and every unpacked tensor: the
    processed values are copied into the live storage, never swapped."""
    for kernel, processed in ((torch.empty(0), torch.empty(0)), (torch.zeros(2, 2), torch.ones(2, 2))):
        layer, info = _layer(processed), _info(kernel)
        live = info.kernel_tensors[0]["weight"]
        _adopt_released_kernel_tensors(layer, info, "o_proj")
        assert info.kernel_tensors[0]["weight"] is live


def test_any_other_shape_change_is_refused_by_name() -> None:
    layer, info = _layer(torch.zeros(4, 4)), _info(torch.zeros(2, 4))
    with pytest.raises(
        DestinationError, match=r"q_b_proj\.weight: .* \[4, 4\], the live kernel tensor is \[2, 4\]"
    ):
        _adopt_released_kernel_tensors(layer, info, "q_b_proj")
