"""Layout conventions (DESIGN 4) as data: `get_layout("megatron" | "vllm" | "hf")`."""

from __future__ import annotations

from sync_runtime.core.layouts.base import Layout
from sync_runtime.core.layouts.hf import HfLayout
from sync_runtime.core.layouts.megatron import MegatronLayout
from sync_runtime.core.layouts.vllm import VllmLayout
from sync_runtime.errors import LayoutError

LAYOUTS: dict[str, Layout] = {"hf": HfLayout(), "megatron": MegatronLayout(), "vllm": VllmLayout()}


def get_layout(name: str) -> Layout:
    """The layout registered under `name`; LayoutError listing the known ones otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"unknown layout {name!r} (known: {', '.join(sorted(LAYOUTS))})") from None


__all__ = ["LAYOUTS", "Layout", "LayoutError", "get_layout"]
