"""The planner (design §5): a pure function from manifest and topologies to a `SyncPlan`.

Modules, one concern each: `config` (inputs), `refine` (box geometry, source cells), `needs`
(destination regions), `senders` (choice among identical copies), `schedule` (buckets, rounds),
`relay` (destination chains), `digest`, `stats`, and `api` (`plan_sync`, the entry point).
"""

from sync_runtime.errors import PlanError
from sync_runtime.planner.api import plan_sync
from sync_runtime.planner.config import MiB, PlannerConfig, RelayMode, SideSpec

__all__ = ["MiB", "PlanError", "PlannerConfig", "RelayMode", "SideSpec", "plan_sync"]
