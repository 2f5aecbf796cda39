"""Everything needed to build and run Megatron-Core 0.19.2 models on CPU over gloo, in one place.

Used by the demo, the tests and the benchmark (a GPU trainer never calls any of it). None of it
changes a weight: each item only keeps a CUDA-only code path off the CPU. Call `install()` before
`megatron` is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_installed = False


def install() -> None:
    """Megatron asks `torch.cuda.current_device()` for the device of rotary frequencies, router
    buffers (expert_bias), TP-mapping gather buffers and DDP buffers; on CPU that must be "cpu"."""
    global _installed
    if not _installed:
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
        _installed = True


def mla_core_attention() -> type:
    """MLASelfAttention passes k_channels/v_channels to its core attention, which the local
    spec's DotProductAttention.__init__ does not accept: a subclass that drops them."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


@contextlib.contextmanager
def tensor_cuda_noop(active: bool) -> Iterator[None]:
    """Tied embeddings with PP > 1: `setup_embeddings_and_output_layer` moves the weight with
    `.cuda()` before the embedding-group all-reduce; keep it where it is while building."""
    if not active:
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def sliding_window_mask_on_cpu() -> Iterator[None]:
    """Sliding-window layers (gpt-oss) build their mask in the local spec's softmax with
    `get_sliding_window_causal_mask`, which allocates on "cuda": the same mask on the CPU while
    a forward runs."""
    from megatron.core.fusions import fused_softmax

    original = fused_softmax.get_sliding_window_causal_mask

    def on_cpu(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(
            torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1]
        )

    fused_softmax.get_sliding_window_causal_mask = on_cpu
    try:
        yield
    finally:
        fused_softmax.get_sliding_window_causal_mask = original


def causal_mask(seq_len: int) -> torch.Tensor:
    """`get_default_causal_mask` allocates on "cuda": pass the mask instead (True = masked)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


CPU_CONFIG: dict[str, Any] = {
    # Fused kernels and CUDA-side init exist only on GPU.
    "use_cpu_initialization": True,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
    # The local spec's WrappedTorchNorm asserts not sequence_parallel.
    "sequence_parallel": False,
}
CPU_MOE_CONFIG: dict[str, Any] = {
    # The alltoall dispatcher and grouped GEMM / permute fusion need CUDA kernels.
    "moe_token_dispatcher_type": "allgather",
    "moe_grouped_gemm": False,
    "moe_permute_fusion": False,
}
