"""Layout conventions (design §4) as data: `get_layout("megatron" | "megatron-te" | "vllm" | "hf")`."""

from __future__ import annotations

from sync_runtime.core.layouts.base import Layout
from sync_runtime.core.layouts.hf import HfLayout
from sync_runtime.core.layouts.megatron import TE, MegatronLayout
from sync_runtime.core.layouts.vllm import VllmLayout
from sync_runtime.errors import LayoutError

# "megatron": Megatron-Core's local spec (what runs without Transformer Engine); "megatron-te":
# the same model built with the Transformer Engine spec, whose norm and expert names differ.
LAYOUTS: dict[str, Layout] = {
    "hf": HfLayout(),
    "megatron": MegatronLayout(),
    "megatron-te": MegatronLayout(TE),
    "vllm": VllmLayout(),
}


def get_layout(name: str) -> Layout:
    """The layout registered under `name`; LayoutError listing the known ones otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"unknown layout {name!r} (known: {', '.join(sorted(LAYOUTS))})") from None


__all__ = ["LAYOUTS", "Layout", "LayoutError", "get_layout"]
