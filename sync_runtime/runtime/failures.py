"""How a failed stage travels inside the coordinator."""

from __future__ import annotations

from sync_runtime.schema.report import SyncFailure


class StepFailed(Exception):
    """A sync stage failed; carries the report's failure."""

    def __init__(self, failure: SyncFailure, unfinished: frozenset[int] = frozenset()) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.unfinished = unfinished
        """Ranks still inside a remote call: their calls queue behind it, so nobody waits on them."""
