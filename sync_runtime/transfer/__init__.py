"""Transfer engine: executes a RankPlan over a standalone torch.distributed process group.

Public API (used by the coordinator and the Ray participants):
`SyncGroup`, `TransferConfig`, `DestinationWeights` (a `Staging`; policies host/device/inplace),
`CommitRecord` (the two-phase commit record), `snapshot` (source fence), `run_rank_plan` (with its test-only
`EngineHooks`), `RankResult`, `verify_plan_against_tensors`, `checksum_tensor`, and
`publish_failure` (the coordinator's way to fail a sync for a rank that died or hangs).
Its failures are the classes of `sync_runtime.errors`.
"""

from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from sync_runtime.transfer.config import RankResult, TransferConfig
from sync_runtime.transfer.engine import EngineHooks, run_rank_plan
from sync_runtime.transfer.fence import snapshot
from sync_runtime.transfer.group import SyncGroup, publish_failure
from sync_runtime.transfer.staging import POLICIES, DestinationWeights, MemoryMeter, Staging, StagingPolicy
from sync_runtime.transfer.txn import CommitRecord, LocalTxn, commit_decision, parse_decision
from sync_runtime.transfer.verify import verify_plan_against_tensors

__all__ = [
    "POLICIES",
    "CommitRecord",
    "DestinationWeights",
    "EngineHooks",
    "LocalTxn",
    "MemoryMeter",
    "RankResult",
    "Staging",
    "StagingPolicy",
    "SyncGroup",
    "TransferConfig",
    "checksum_tensor",
    "commit_decision",
    "hex_digest",
    "parse_decision",
    "publish_failure",
    "run_rank_plan",
    "snapshot",
    "verify_plan_against_tensors",
]
