"""What a sync report says about its plan (a module of its own: coordinator.py is at its size limit)."""

from __future__ import annotations

from typing import Any

from sync_runtime.core.plan import SyncPlan


def plan_fields(plan: SyncPlan | None) -> dict[str, Any]:
    """SyncReport's plan fields: digest, rounds, transfers, relay, and what the plan leaves out of
    the checkpoint (`not_synced`, e.g. MTP layers). No plan (discovery failed): the defaults."""
    if plan is None:
        return {}
    return {
        "plan_digest": plan.digest,
        "rounds": len(plan.rounds),
        "transfers": sum(len(b.transfers) for r in plan.rounds for b in r.buckets),
        "relay": plan.relay,
        "not_synced": list(plan.stats.get("not_synced", ())),
    }
