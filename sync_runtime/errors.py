"""Every WeightSync failure: one hierarchy, one wire form, one table of condition reasons.

A failure is raised as a subclass of `WeightSyncError` carrying where it happened (rank, step,
tensor, peer) as fields, never only inside its message. It crosses a process boundary once, as
`SyncFailure` (`to_failure` / `from_failure`), and reaches the CR's conditions with the reason its
class declares. Nothing anywhere classifies a failure by reading its message.

`REASONS` is the table: the reason of every failure kind, whether a retry can fix it, and its
rank as a root cause (lower explains higher: a rank that died explains its peers' timeouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SyncStep(StrEnum):
    DISCOVER = "discover"
    PLAN = "plan"
    CONNECT = "connect"
    TRANSFER = "transfer"
    VERIFY = "verify"
    COMMIT = "commit"


class Reason(StrEnum):
    """Condition reasons (CamelCase, as metav1.Condition wants them)."""

    INVALID_TOPOLOGY = "InvalidTopology"
    INVALID_LAYOUT = "InvalidLayout"
    PLAN_FAILED = "PlanFailed"
    DISCOVERY_FAILED = "DiscoveryFailed"
    TOPOLOGY_MISMATCH = "TopologyMismatch"
    RAY_UNREACHABLE = "RayClusterUnreachable"
    RAY_CLUSTER_NOT_FOUND = "RayClusterNotFound"
    RAY_CLUSTER_NOT_READY = "RayClusterNotReady"
    PLAN_MISMATCH = "PlanMismatch"
    CONNECT_FAILED = "ConnectFailed"
    REMOTE_CALL_FAILED = "RemoteCallFailed"
    PARTICIPANT_DIED = "ParticipantDied"
    TRANSFER_TIMEOUT = "TransferTimeout"
    CHECKSUM_MISMATCH = "ChecksumMismatch"
    PEER_FAILED = "PeerFailed"
    SOURCE_ERROR = "SourceError"
    DESTINATION_ERROR = "DestinationError"
    VERIFY_FAILED = "VerifyFailed"
    COMMIT_FAILED = "CommitFailed"
    SOURCE_CHANGED = "SourceChanged"
    MIXED_VERSIONS = "MixedVersions"
    POISONED = "Poisoned"
    INTERNAL_ERROR = "InternalError"


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    retryable: bool
    """False when only a change of the spec or the deployments can fix it."""
    root_cause: int
    """Among simultaneous failures of one sync the lowest is reported: it explains the others."""


REASONS: dict[Reason, ReasonInfo] = {
    Reason.INVALID_TOPOLOGY: ReasonInfo(retryable=False, root_cause=1),
    Reason.INVALID_LAYOUT: ReasonInfo(retryable=False, root_cause=1),
    Reason.PLAN_FAILED: ReasonInfo(retryable=False, root_cause=1),
    Reason.DISCOVERY_FAILED: ReasonInfo(retryable=True, root_cause=1),
    Reason.TOPOLOGY_MISMATCH: ReasonInfo(retryable=False, root_cause=1),
    Reason.RAY_UNREACHABLE: ReasonInfo(retryable=True, root_cause=1),
    # Retryable: the runtime keeps polling, so creating the RayCluster (or its head coming up) heals it.
    Reason.RAY_CLUSTER_NOT_FOUND: ReasonInfo(retryable=True, root_cause=1),
    Reason.RAY_CLUSTER_NOT_READY: ReasonInfo(retryable=True, root_cause=1),
    Reason.PLAN_MISMATCH: ReasonInfo(retryable=True, root_cause=1),
    Reason.CONNECT_FAILED: ReasonInfo(retryable=True, root_cause=1),
    Reason.REMOTE_CALL_FAILED: ReasonInfo(retryable=True, root_cause=1),
    Reason.PARTICIPANT_DIED: ReasonInfo(retryable=True, root_cause=0),
    Reason.TRANSFER_TIMEOUT: ReasonInfo(retryable=True, root_cause=3),
    Reason.CHECKSUM_MISMATCH: ReasonInfo(retryable=True, root_cause=1),
    Reason.PEER_FAILED: ReasonInfo(retryable=True, root_cause=4),
    Reason.SOURCE_ERROR: ReasonInfo(retryable=True, root_cause=1),
    Reason.DESTINATION_ERROR: ReasonInfo(retryable=True, root_cause=1),
    Reason.VERIFY_FAILED: ReasonInfo(retryable=True, root_cause=1),
    Reason.COMMIT_FAILED: ReasonInfo(retryable=True, root_cause=1),
    # The trainer stepped while its shards were read: the next sync (or snapshot=true) fixes it.
    Reason.SOURCE_CHANGED: ReasonInfo(retryable=True, root_cause=1),
    # A replica whose ranks hold different versions, or one left half written by an in-place
    # sync: it stays out of serving and the next sync resends it in full.
    Reason.MIXED_VERSIONS: ReasonInfo(retryable=True, root_cause=1),
    Reason.POISONED: ReasonInfo(retryable=True, root_cause=1),
    Reason.INTERNAL_ERROR: ReasonInfo(retryable=True, root_cause=1),
}


class SyncFailure(BaseModel):
    """A failure on the wire (Ray results, the store, the report, the CR's status)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    reason: str
    """One of `Reason` (kept a string so a newer runtime's reason still parses)."""
    message: str
    rank: int | None = None
    step: SyncStep | None = None
    tensor: str | None = None
    peer: int | None = None

    @property
    def root_cause(self) -> int:
        info = REASONS.get(Reason(self.reason)) if self.reason in Reason else None
        return info.root_cause if info else 1

    @property
    def retryable(self) -> bool:
        info = REASONS.get(Reason(self.reason)) if self.reason in Reason else None
        return info.retryable if info else True


class WeightSyncError(Exception):
    """Base of every failure WeightSync reports. Subclasses fix the reason (and a default step)."""

    reason: ClassVar[Reason] = Reason.INTERNAL_ERROR
    step_default: ClassVar[SyncStep | None] = None

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: SyncStep | None = None,
        tensor: str | None = None,
        peer: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.step = step if step is not None else self.step_default
        self.tensor = tensor
        self.peer = peer

    def __reduce__(self):  # keyword fields survive pickling (Ray, multiprocessing)
        return (_rebuild, (type(self), self.message, self.rank, self.step, self.tensor, self.peer))

    wire_reason: str | None = None
    """A reason this runtime does not know (a newer participant's), kept so it is passed on as is."""

    def to_failure(self) -> SyncFailure:
        return SyncFailure(
            reason=self.wire_reason or self.reason.value,
            message=self.message,
            rank=self.rank,
            step=self.step,
            tensor=self.tensor,
            peer=self.peer,
        )

    @classmethod
    def from_failure(cls, failure: SyncFailure) -> WeightSyncError:
        """The typed error of a failure read back from the wire."""
        kind = _BY_REASON.get(failure.reason, WeightSyncError)
        error = kind(
            failure.message, rank=failure.rank, step=failure.step, tensor=failure.tensor, peer=failure.peer
        )
        if failure.reason not in _BY_REASON:
            error.wire_reason = failure.reason
        return error

    def located(self, **fields: int | str | SyncStep | None) -> Self:
        """Fill in location fields that are still unknown (the caller knows more than the raiser)."""
        for name, value in fields.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        return self


def _rebuild(kind: type[WeightSyncError], message: str, rank, step, tensor, peer) -> WeightSyncError:
    return kind(message, rank=rank, step=step, tensor=tensor, peer=peer)


# ---- bad input, found before any byte moves ------------------------------------------------


class TopologyError(WeightSyncError, ValueError):
    """A parallelism that cannot hold the model or is inconsistent in itself."""

    reason = Reason.INVALID_TOPOLOGY
    step_default = SyncStep.PLAN


class LayoutError(WeightSyncError, ValueError):
    """A layout cannot express the model or a rank's tensors (unknown name, wrong shape, ...)."""

    reason = Reason.INVALID_LAYOUT
    step_default = SyncStep.DISCOVER


class ModelConfigError(LayoutError):
    """A config.json WeightSync cannot build a manifest from."""


class PlanError(WeightSyncError, ValueError):
    """The planner was given settings or sides it cannot plan."""

    reason = Reason.PLAN_FAILED
    step_default = SyncStep.PLAN


class DiscoveryError(WeightSyncError, RuntimeError):
    """Participants could not be found or did not answer; the message names the actor or prefix."""

    reason = Reason.DISCOVERY_FAILED
    step_default = SyncStep.DISCOVER


class TopologyMismatchError(WeightSyncError, ValueError):
    """Discovered participants disagree with the declared topology or the manifest."""

    reason = Reason.TOPOLOGY_MISMATCH
    step_default = SyncStep.DISCOVER


class RayUnreachableError(WeightSyncError, RuntimeError):
    """The runtime cannot connect to the participants' Ray cluster."""

    reason = Reason.RAY_UNREACHABLE
    step_default = SyncStep.DISCOVER


class RayClusterNotFoundError(RayUnreachableError):
    """`rayCluster: NAME` names no KubeRay RayCluster in the WeightSync's namespace."""

    reason = Reason.RAY_CLUSTER_NOT_FOUND


class RayClusterNotReadyError(RayUnreachableError):
    """The named RayCluster exists but reports no head address (yet), or an unusable GCS port."""

    reason = Reason.RAY_CLUSTER_NOT_READY


# ---- failures during a sync ----------------------------------------------------------------


class PlanMismatchError(WeightSyncError, ValueError):
    """A rank's plan disagrees with its tensors or with the plan the others run (digest)."""

    reason = Reason.PLAN_MISMATCH
    step_default = SyncStep.PLAN


class ConnectError(WeightSyncError, RuntimeError):
    """The sync's process group could not be formed or is no longer healthy."""

    reason = Reason.CONNECT_FAILED
    step_default = SyncStep.CONNECT


class RemoteCallFailed(WeightSyncError, RuntimeError):
    """A call to a participant failed or did not answer in time."""

    reason = Reason.REMOTE_CALL_FAILED


class ParticipantError(RemoteCallFailed):
    """A participant refused a call made out of order (ws_init never called, an unknown tensor,
    a role that disagrees with its coordinates): the call failed, on the participant's side."""


class ParticipantDied(WeightSyncError, RuntimeError):
    """A participant's process is gone."""

    reason = Reason.PARTICIPANT_DIED


class TransferError(WeightSyncError, RuntimeError):
    """A failure while moving bytes; subclasses say which kind."""

    reason = Reason.INTERNAL_ERROR
    step_default = SyncStep.TRANSFER


class TransferTimeout(TransferError):
    reason = Reason.TRANSFER_TIMEOUT


class ChecksumMismatch(TransferError):
    reason = Reason.CHECKSUM_MISMATCH
    step_default = SyncStep.VERIFY


class PeerFailed(TransferError):
    """This rank stopped because `peer` failed first."""

    reason = Reason.PEER_FAILED


class StagingError(TransferError):
    """Staging was used out of order (commit without begin, unknown tensor)."""

    reason = Reason.DESTINATION_ERROR


class SourceError(WeightSyncError, RuntimeError):
    """The source engine failed while providing its shards."""

    reason = Reason.SOURCE_ERROR
    step_default = SyncStep.TRANSFER


class DestinationError(WeightSyncError, RuntimeError):
    """A destination engine failed while receiving or applying its shards."""

    reason = Reason.DESTINATION_ERROR
    step_default = SyncStep.TRANSFER


class VerifyFailed(WeightSyncError, RuntimeError):
    reason = Reason.VERIFY_FAILED
    step_default = SyncStep.VERIFY


class CommitFailed(WeightSyncError, RuntimeError):
    reason = Reason.COMMIT_FAILED
    step_default = SyncStep.COMMIT


class SourceChanged(SourceError):
    """A source tensor changed between the first byte read and the last (a training step ran
    during the sync): the bytes sent may mix two steps, so no destination commits them."""

    reason = Reason.SOURCE_CHANGED


class MixedVersions(CommitFailed):
    """The ranks of a replica ended on different versions (one died or failed its commit after
    the decision): the replica stays out of serving until a sync repairs it."""

    reason = Reason.MIXED_VERSIONS


class ReplicaPoisoned(CommitFailed):
    """An in-place sync failed after bytes had landed in live memory: the replica holds neither
    version and stays out of serving until a sync resends it in full."""

    reason = Reason.POISONED


class InternalError(WeightSyncError, RuntimeError):
    """A bug: an exception WeightSync did not expect. The traceback goes to the log only."""

    reason = Reason.INTERNAL_ERROR


def _leaf_classes() -> dict[str, type[WeightSyncError]]:
    table: dict[str, type[WeightSyncError]] = {}
    pending: list[type[WeightSyncError]] = [WeightSyncError]
    while pending:
        kind = pending.pop(0)  # breadth first: general classes before their subclasses
        # The most general class of a reason wins, so from_failure never invents detail.
        table.setdefault(kind.reason.value, kind)
        pending.extend(kind.__subclasses__())
    return table


_BY_REASON = _leaf_classes()


def describe_unexpected(e: BaseException) -> str:
    """One line for an exception WeightSync did not raise itself: its type and last message line,
    never a traceback (those go to the log)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]
