"""Fault injection for tests: `EngineHooks` that break a sync exactly where real faults happen.

The engine calls its optional observer at two points (after a bucket was packed and
checksummed, before a round is posted); these build the observers the fault tests use. A local
rank passes one to `run_rank_plan(hooks=...)`; a Ray participant takes one through its
`_ws_hooks` attribute (`FaultArming.ws_arm`), which `ws_run` hands to the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from sync_runtime.core.plan import Bucket
from sync_runtime.transfer import EngineHooks

BucketFilter = Callable[[int, Bucket], bool]
"""(round, bucket) -> whether to corrupt that bucket's message."""


def corrupt_after_pack(offset: int = 0, mask: int = 0xFF, only: BucketFilter | None = None) -> EngineHooks:
    """Flip bits of a packed message after its checksum was taken: the receiver must catch it."""

    def flip(round_index: int, bucket: Bucket, tail: torch.Tensor) -> None:
        if only is None or only(round_index, bucket):
            tail[offset] ^= mask

    return EngineHooks(after_pack=flip)


def raise_before_round(message: str) -> EngineHooks:
    """The engine's caller fails mid-sync (e.g. a trainer whose buffers went away)."""

    def boom(round_index: int) -> None:
        raise RuntimeError(f"{message} before round {round_index}")

    return EngineHooks(before_round=boom)


def sleep_before_round(seconds: float) -> EngineHooks:
    """A rank that stalls (past its peers' timeouts when `seconds` is large enough)."""
    return EngineHooks(before_round=lambda _round: time.sleep(seconds))


def exit_before_round(round_index: int, code: int) -> EngineHooks:
    """A rank whose process dies between two rounds, without a word to its peers."""

    def die(i: int) -> None:
        if i == round_index:
            os._exit(code)

    return EngineHooks(before_round=die)


def hooks_for(fault: str | None, seconds: float = 0.0) -> EngineHooks | None:
    """The observer of a named fault (what the Ray fault tests arm remotely); None disarms."""
    if fault is None:
        return None
    if fault == "raise":
        return raise_before_round("injected trainer failure")
    if fault == "corrupt":
        return corrupt_after_pack()
    if fault == "sleep":
        return sleep_before_round(seconds)
    raise ValueError(f"unknown fault {fault!r}")


def flip_first_staged_byte(staging) -> None:
    """A participant's `_ws_before_commit` observer: flip one staged byte right before the commit
    applies it (after the decision), so the rank's re-check of its staging refuses the commit."""
    name = sorted(staging.tensors)[0]
    staging.staged(name).reshape(-1).view(torch.uint8)[0] ^= 0xFF


class FaultArming:
    """Mixin for a test participant class: `ws_arm(fault)` sets the hooks its next ws_run uses."""

    _ws_hooks: EngineHooks | None

    def ws_arm(self, fault: str | None, seconds: float = 0.0) -> None:
        self._ws_hooks = hooks_for(fault, seconds)
