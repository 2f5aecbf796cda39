"""The kernel view of an engine with an MTP drafter (engines/vllm_drafter.WithDrafter): the
target's tensors under their own names, the drafter's own under `drafter.`, modules the drafter
shares with the target (embedding, lm_head) once, as the target's. Pure torch: stand-in modules
shaped like vLLM's (a drafter whose embed_tokens IS the target's module)."""

from __future__ import annotations

import pytest
import torch

from sync_runtime.engines.vllm_apply import kernel_state
from sync_runtime.engines.vllm_drafter import WithDrafter

pytestmark = pytest.mark.unit


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.model.embed_tokens = torch.nn.Embedding(10, 4)
    target.model.norm = torch.nn.LayerNorm(4)
    target.lm_head = torch.nn.Linear(4, 10, bias=False)
    drafter = torch.nn.Module()
    drafter.model = torch.nn.Module()
    drafter.model.embed_tokens = target.model.embed_tokens  # shared, as vLLM's proposer does
    drafter.model.eh_proj = torch.nn.Linear(8, 4, bias=False)
    drafter.model.head = target.lm_head
    return target, drafter


def test_target_names_unchanged_drafter_own_prefixed_shared_once() -> None:
    target, drafter = _models()
    view = kernel_state(WithDrafter(target, drafter))
    alone = kernel_state(target)
    assert {n: t for n, t in view.items() if not n.startswith("drafter.")}.keys() == alone.keys()
    assert set(view) - set(alone) == {"drafter.model.eh_proj.weight"}
    assert view["drafter.model.eh_proj.weight"] is not None
    # Negative control: walked without the view's memo, the shared modules would appear twice.
    twice = {f"drafter.{n}" for n in kernel_state(drafter)}
    assert "drafter.model.embed_tokens.weight" in twice and "drafter.model.embed_tokens.weight" not in view


def test_the_view_owns_nothing() -> None:
    target, drafter = _models()
    view = WithDrafter(target, drafter)
    assert list(view.parameters(recurse=False)) == [] and list(view.children()) == []
    assert view.state_dict() == {}  # never a way to move or save the engine's tensors
