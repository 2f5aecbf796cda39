"""metav1.Condition bookkeeping: lastTransitionTime moves only when a condition's status flips."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sync_runtime.schema.public import public_message
from sync_runtime.schema.status import Condition

_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_MESSAGE = 32768


@dataclass(frozen=True, slots=True)
class ConditionUpdate:
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""


def safe_reason(text: str | None, fallback: str) -> str:
    """A reason the Condition schema accepts; reasons from reports or the kubelet are checked, not trusted."""
    if text and len(text) <= 1024 and _REASON.match(text):
        return text
    return fallback


def merge_conditions(
    prior: Sequence[Condition], updates: Sequence[ConditionUpdate], now: datetime, generation: int | None
) -> list[Condition]:
    """The new condition list, in `updates` order; conditions of other types are kept after them."""
    old = {c.type: c for c in prior}
    out = []
    for u in updates:
        before = old.pop(u.type, None)
        flipped = before is None or before.status != u.status
        out.append(
            Condition(
                type=u.type,
                status=u.status,
                reason=u.reason,
                # Every condition message passes here: no traceback reaches status.
                message=public_message(u.message)[:MAX_MESSAGE],
                last_transition_time=now if flipped else before.last_transition_time,  # type: ignore[union-attr]
                observed_generation=generation,
            )
        )
    out.extend(old.values())
    return out
