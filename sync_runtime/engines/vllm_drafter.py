"""A vLLM engine's MTP drafter as part of its destination rank (DeepSeek-V3's draft layers).

An engine started with MTP speculative decoding holds a second model in each worker, the drafter
(`vllm_apply.mtp_drafter`). Its rank reports the drafter's tensors next to the target's, under
the `vllm` layout's names (`drafter.` + the drafter's own parameter names: layouts/vllm.py
DRAFTER), so discovery finds that the side serves MTP (runtime/mtp_side.py) and the plan sends
it the MTP part. Parameters the drafter shares with the target (embed_tokens, the lm_head its
MTP layers use as `shared_head.head`) are the target's and are reported and applied once, as the
target's. At commit the target is applied first, then the drafter, each through the same steps
(vllm_apply.apply_shards: vLLM's own post-load processing, CPU repacking, MLA W_UK_T/W_UV
re-derived from kv_b_proj), the drafter's attention with the drafter's model config. An engine
without a drafter takes none of these paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from sync_runtime.core.layouts.vllm import DRAFTER
from sync_runtime.engines.vllm_apply import (
    ApplyReport,
    EngineTensor,
    apply_shards,
    draft_model_config,
    engine_tensors,
)

DRAFTER_PENDING = ("drafter", None)
"""A weightsync backend worker's init answer when its engine speculates with MTP: it becomes a
rank (`ws_setup`) only inside the draft-model session the proxy opens next, where vLLM hands it
the drafter (vllm_plugin/backend.py, vllm_ranks.py). Not in vllm_plugin/__init__.py: that whole
file is part of every oracle's cache key (testing/reference_cache.ENGINE_CODE)."""


def speculates_with_mtp(vllm_config: Any) -> bool:
    """Whether the engine's speculative method is "mtp" (vLLM 0.32 normalises "deepseek_mtp" and
    the like to it): its drafter holds the MTP part, as `vllm_apply.mtp_drafter` finds it."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return speculative is not None and getattr(speculative, "method", None) == "mtp"


def drafter_tensors(
    drafter: torch.nn.Module, target: torch.nn.Module, model_dtype: torch.dtype
) -> dict[str, EngineTensor]:
    """The drafter's tensors a sync writes, named as the `vllm` layout names them."""
    own = engine_tensors(drafter, model_dtype, shared=list(target.parameters()))
    return {DRAFTER + n: dataclasses.replace(t, name=DRAFTER + n) for n, t in own.items()}


def apply_with_drafter(
    target: torch.nn.Module, drafter: torch.nn.Module, vllm_config: Any, staged: Mapping[str, torch.Tensor]
) -> ApplyReport:
    """The target's tensors of `staged`, then the drafter's (after the target: the drafter's
    reload walks the shared embedding and lm_head and puts back what the target's apply left)."""
    main = {n: t for n, t in staged.items() if not n.startswith(DRAFTER)}
    draft = {n.removeprefix(DRAFTER): t for n, t in staged.items() if n.startswith(DRAFTER)}
    first = apply_shards(target, vllm_config, main)
    second = apply_shards(drafter, vllm_config, draft, draft_model_config(vllm_config))
    return ApplyReport(
        first.modules + second.modules,
        first.tensors + second.tensors,
        first.moe_kernels + second.moe_kernels,
        first.tied_reprocessed + tuple(DRAFTER + m for m in second.tied_reprocessed),
    )


class WithDrafter(torch.nn.Module):
    """The target and its drafter as one module tree for `vllm_apply.kernel_state`: the target's
    modules under their own names, then the drafter's not already seen under `drafter.` (the
    shared embedding and lm_head appear once, as the target's). Registers neither: it only
    walks them, and never moves or owns their tensors."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module) -> None:
        super().__init__()
        self._walked = (target, drafter)  # a plain tuple: not registered as submodules

    def named_modules(
        self, memo: set[torch.nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Module]]:
        memo = set() if memo is None else memo
        target, drafter = self._walked
        yield from target.named_modules(memo, prefix, remove_duplicate)
        yield from drafter.named_modules(memo, prefix + DRAFTER.rstrip("."), remove_duplicate)
