"""What may reach status and Events: a reason's message, never a traceback (runtime and operator)."""

from __future__ import annotations

import re

_TRACEBACK_LINE = re.compile(r'^\s*(Traceback \(most recent call last\):|File ".*", line \d+)', re.MULTILINE)
MAX_PUBLIC_MESSAGE = 4096
TRACEBACK_NOTE = " (details in the runtime's log)"


def public_message(text: str | None) -> str:
    """`text` fit for status and Events: a reason's message, never a traceback.

    Status and Events are readable by everyone who can read the WeightSync, and tracebacks carry
    paths, locals and library internals; they belong in the pod's log. A message that looks like a
    traceback is cut to its last line (the exception itself), and every message to 4 KB.
    """
    if not text:
        return ""
    if _TRACEBACK_LINE.search(text):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if not _TRACEBACK_LINE.match(ln)), "")
        text = (last[: MAX_PUBLIC_MESSAGE - len(TRACEBACK_NOTE)] if last else "failed") + TRACEBACK_NOTE
    return text[:MAX_PUBLIC_MESSAGE]
