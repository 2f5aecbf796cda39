"""Layout conventions (DESIGN 4) as data: `get_layout("megatron" | "vllm" | "hf")`."""

from __future__ import annotations

from sync_runtime.layouts.base import Layout, LayoutError
from sync_runtime.layouts.hf import HfLayout
from sync_runtime.layouts.megatron import MegatronLayout
from sync_runtime.layouts.vllm import VllmLayout

LAYOUTS: dict[str, Layout] = {"hf": HfLayout(), "megatron": MegatronLayout(), "vllm": VllmLayout()}


def get_layout(name: str) -> Layout:
    """The layout registered under `name`; LayoutError listing the known ones otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"unknown layout {name!r} (known: {', '.join(sorted(LAYOUTS))})") from None


__all__ = ["LAYOUTS", "Layout", "LayoutError", "get_layout"]
