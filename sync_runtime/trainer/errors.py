"""What can go wrong on the trainer's side of a push, besides the sync itself failing.

A sync that ran and failed raises the runtime's own typed `WeightSyncError` (its reason is the
condition's). These are the other outcomes: the trainer could not learn a result for its version
(the WeightSync is missing, the deadline passed, someone asked for a newer version first). They
are not `WeightSyncError`s on purpose: none of them says the transfer failed, and none has a
condition reason of its own.
"""

from __future__ import annotations


class PushError(Exception):
    """Base of the trainer-side push errors."""


class WeightSyncNotFound(PushError, LookupError):
    """The WeightSync to push to does not exist (or was deleted while waiting)."""

    def __init__(self, namespace: str, name: str, *, deleted: bool = False) -> None:
        what = "was deleted while waiting" if deleted else "does not exist"
        super().__init__(f"WeightSync {namespace}/{name} {what}")
        self.namespace, self.name, self.deleted = namespace, name, deleted


class PushTimeout(PushError, TimeoutError):
    """No outcome for `version` before the deadline; says what the WeightSync showed last."""

    def __init__(self, version: str, seconds: float, phase: str | None, reason: str | None) -> None:
        detail = f"phase {phase or 'unknown'}" + (f", reason {reason}" if reason else "")
        super().__init__(f"version {version} not synced within {seconds:g}s (last seen: {detail})")
        self.version, self.seconds, self.phase, self.reason = version, seconds, phase, reason


class VersionSuperseded(PushError):
    """spec.version moved on to `newer` (another writer) before `version` was synced: the runtime
    syncs only the newest desired version, so `version` will never be reported."""

    def __init__(self, version: str, newer: str) -> None:
        super().__init__(f"version {version} was superseded by {newer} before it was synced")
        self.version, self.newer = version, newer


__all__ = ["PushError", "PushTimeout", "VersionSuperseded", "WeightSyncNotFound"]
