"""Transfer engine: executes a RankPlan over a standalone torch.distributed process group.

Public API (used by the coordinator and the Ray participants):
`SyncGroup`, `TransferConfig`, `DestinationWeights`, `run_rank_plan`, `RankResult`,
`verify_plan_against_tensors`, `PlanMismatchError`, `TransferError`, `checksum_tensor`, and
`publish_failure` (the coordinator's way to fail a sync for a rank that died or hangs).
"""

from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from sync_runtime.transfer.config import (
    PlanMismatchError,
    RankResult,
    StagingError,
    TransferConfig,
    TransferError,
)
from sync_runtime.transfer.engine import run_rank_plan
from sync_runtime.transfer.group import ConnectError, SyncGroup, publish_failure
from sync_runtime.transfer.staging import DestinationWeights
from sync_runtime.transfer.verify import verify_plan_against_tensors

__all__ = [
    "ConnectError",
    "DestinationWeights",
    "PlanMismatchError",
    "RankResult",
    "StagingError",
    "SyncGroup",
    "TransferConfig",
    "TransferError",
    "checksum_tensor",
    "hex_digest",
    "publish_failure",
    "run_rank_plan",
    "verify_plan_against_tensors",
]
