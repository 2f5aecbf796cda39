"""The trainer's side of a sync: after `optimizer.step()`, one call, one report back.

    sync = InProcessSync(spec)                  # the driver owns the coordinator
    sync = KubernetesSync("policy", "rl")       # or: through the WeightSync's operator
    report = push("step-100", sync)             # == sync.push("step-100")

Both raise the typed `WeightSyncError` of a failed sync (its reason is the condition reason);
the Kubernetes path also raises the `PushError`s of `trainer.errors`. `InProcessSync` is
imported lazily: a trainer that only pushes through Kubernetes never imports Ray or torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from sync_runtime.schema.report import SyncReport
from sync_runtime.trainer.errors import PushError, PushTimeout, VersionSuperseded, WeightSyncNotFound
from sync_runtime.trainer.kube import KubernetesSync

if TYPE_CHECKING:
    from sync_runtime.trainer.inprocess import InProcessSync


class SyncTarget(Protocol):
    def push(self, version: str) -> SyncReport: ...


def push(version: str, target: SyncTarget) -> SyncReport:
    """Sync `version` through `target` (InProcessSync or KubernetesSync) and return its report."""
    return target.push(version)


def __getattr__(name: str) -> Any:
    if name == "InProcessSync":
        from sync_runtime.trainer.inprocess import InProcessSync

        return InProcessSync
    raise AttributeError(name)


__all__ = [
    "InProcessSync",
    "KubernetesSync",
    "PushError",
    "PushTimeout",
    "SyncTarget",
    "VersionSuperseded",
    "WeightSyncNotFound",
    "push",
]
