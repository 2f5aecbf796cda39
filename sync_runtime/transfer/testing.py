"""Test-only fault injection. Production code never sets these; tests set them inside a spawned rank.

Kept to two call sites in the engine so that the faults tests inject (a corrupted byte after the
checksum was taken, a crash in the middle of a sync) happen exactly where real ones would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sync_runtime.core.plan import Bucket


@dataclass(slots=True)
class FaultHooks:
    after_pack: Callable[[int, Bucket, torch.Tensor], None] | None = None
    """(round, bucket, tail message) after a bucket was packed and checksummed. The tail holds the
    small transfers' bytes, then the header of every transfer's checksum: flipping any of its
    bytes must fail the receiver's verification."""
    before_round: Callable[[int], None] | None = None
    """(round) before a round's messages are posted."""


HOOKS = FaultHooks()


def reset_hooks() -> None:
    HOOKS.after_pack = None
    HOOKS.before_round = None
