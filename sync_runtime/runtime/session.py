"""What a coordinator keeps between syncs while the topology holds: the plan and the group."""

from __future__ import annotations

from dataclasses import dataclass

from sync_runtime.core.plan import SyncPlan
from sync_runtime.runtime.discovery import Participant


@dataclass(slots=True)
class Session:
    """What survives between syncs while the topology is unchanged: the plan and the group."""

    topology_digest: str
    plan: SyncPlan
    participants: tuple[Participant, ...]
    """Indexed by global rank."""
    group_name: str
    joined: bool = False
    plans_sent: bool = False
    syncs: int = 0
    """ws_run calls issued on the current group (the engine's sync id of the latest one)."""
    txn: str = ""
    """Commit record of the latest transfer (`weightsync-txn/<txn>/` in the store)."""
