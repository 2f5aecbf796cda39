"""The participant mixin a Ray actor includes to take part in syncs (`ws_*` remote methods).

A participant holds one rank's shards and exposes the `ws_*` remote methods the coordinator
drives: meta (coordinates and local tensors), join (the sync's single process group), run (its
whole rank plan; the engine handles rounds), commit/abort (the collective decision), version,
checksums. The mixin never decides anything collective; the coordinator does.

Lockstep contract: within one sync every participant runs `ws_run` with the same plan digest
and the same group generation; a participant refuses a plan whose digest differs from the one
the coordinator announced, before any collective call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sync_runtime.core.layouts.base import LocalTensorMeta
from sync_runtime.core.plan import RankPlan
from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.errors import (
    CommitFailed,
    ConnectError,
    DestinationError,
    ParticipantError,
    PlanMismatchError,
    SourceError,
    SyncFailure,
    WeightSyncError,
    describe_unexpected,
)
from sync_runtime.runtime import participant_txn
from sync_runtime.runtime.participant_txn import ProgressWriter, ServingControl
from sync_runtime.transfer import (
    CommitRecord,
    DestinationWeights,
    EngineHooks,
    LocalTxn,
    RankResult,
    Staging,
    SyncGroup,
    TransferConfig,
    run_rank_plan,
    snapshot,
)
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from sync_runtime.transfer.delta_wire import KeptBits, kept_after

log = logging.getLogger("weightsync.participant")


@dataclass(frozen=True, slots=True)
class ParticipantMeta:
    """What a participant reports about itself (`ws_meta`); discovery checks it."""

    role: Role
    coord: RankCoord
    layout: str
    tensors: tuple[LocalTensorMeta, ...]
    node_ip: str
    device: str
    pid: int
    actor_name: str
    actor_id: str
    version: str | None
    """Committed version of a destination; the source reports the version it holds, if any."""
    group_name: str | None
    group_healthy: bool
    model_config: dict[str, Any] | None = field(default=None, compare=False)
    live_base: bool = field(default=False, compare=False)  # live bytes a delta rebuilds from
    kept_version: str | None = field(default=None, compare=False)  # a source's kept copy's version


@dataclass(slots=True)
class _State:
    role: Role
    coord: RankCoord
    layout: str
    tensors: dict[str, torch.Tensor]
    destination: Staging | None
    version: str | None
    model_config: dict[str, Any] | None
    group: SyncGroup | None = None
    group_key: tuple[str, int, int] | None = None
    plans: dict[str, RankPlan] = field(default_factory=dict)
    progress: Any = None
    serving: bool = True
    """A destination's engine may serve its live weights; the coordinator pauses a replica
    before any of its ranks applies a version and resumes it once all of them hold it."""
    txn: LocalTxn | None = None
    record: CommitRecord | None = None
    store: Any = None
    """This rank's client of the coordinator's store, opened once per join: a new client inside a
    sync took up to 5 s, inside the transfer timeout the other ranks were already counting."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Serving switch and commit are atomic for an observer (a threaded actor's other calls)."""
    kept: KeptBits | None = None  # a source's bits of its last successful sync (delta_wire.py)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_sha256(t: torch.Tensor) -> str:
    """Digest of a tensor's raw bytes (bf16 viewed as 16-bit ints), for bit-exact checks."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    if flat.dtype.itemsize == 2:
        flat = flat.view(torch.int16)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


class WeightSyncParticipant(ServingControl):
    """Mixin for a Ray actor that takes part in weight syncs. Call `ws_init` from `__init__`."""

    _ws: _State | None = None
    _ws_hooks: EngineHooks | None = None
    """Test-only observer handed to the engine (fault injection); production never sets it."""
    _ws_before_commit: Any = None
    """Test-only: called with the staging right before a commit applies it (fault injection)."""

    def ws_init(
        self,
        *,
        role: Role | str,
        coord: RankCoord,
        layout: str,
        tensors: Mapping[str, torch.Tensor],
        version: str | None = None,
        model_config: Mapping[str, Any] | None = None,
        destination: Staging | None = None,
        serving: bool = True,
    ) -> None:
        """Register this actor's shards. A destination's tensors become its committed weights.

        `destination`: an engine's own `Staging` (default: DestinationWeights over `tensors`).
        `serving=False`: a destination that (re)joins a replica already running waits for the
        coordinator to resume it, so it never serves next to ranks of another version.
        """
        role = Role(role)
        if coord.role is not role:
            raise ParticipantError(f"coord.role={coord.role.value} disagrees with role={role.value}")
        live = dict(tensors)
        coord = _placed(coord, live)
        dest = destination
        if dest is None and role is Role.DESTINATION:
            dest = DestinationWeights(live, version or "")
        self._ws = _State(
            role=role,
            coord=coord,
            layout=layout,
            tensors=live,
            destination=dest,
            version=version,
            model_config=dict(model_config) if model_config is not None else None,
            serving=serving,
        )

    # ---- metadata -------------------------------------------------------------------------

    def _ws_state(self) -> _State:
        if self._ws is None:
            raise ParticipantError(f"{type(self).__name__}: ws_init was never called")
        return self._ws

    def ws_meta(self) -> ParticipantMeta:
        import ray

        st = self._ws_state()
        ctx = ray.get_runtime_context()
        metas = tuple(
            LocalTensorMeta(name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
            for n, t in self._ws_live().items()
        )
        healthy = st.group is not None and bool(st.group.healthy)
        return ParticipantMeta(
            role=st.role,
            coord=st.coord,
            layout=st.layout,
            tensors=metas,
            node_ip=ray.util.get_node_ip_address(),
            device=st.coord.device,
            pid=os.getpid(),
            actor_name=ctx.get_actor_name() or "",
            actor_id=ctx.get_actor_id() or "",
            version=self.ws_version(),
            group_name=st.group_key[0] if st.group_key else None,
            group_healthy=healthy,
            model_config=st.model_config,
            live_base=isinstance(st.destination, DestinationWeights),
            kept_version=st.kept.version if st.kept is not None else None,
        )

    def _ws_live(self) -> dict[str, torch.Tensor]:
        st = self._ws_state()
        if st.destination is not None:
            return dict(st.destination.tensors)
        return st.tensors

    def ws_version(self) -> str | None:
        st = self._ws_state()
        return st.destination.version if st.destination is not None else st.version

    def ws_checksums(self) -> dict[str, str]:
        """Per-tensor checksums of the committed weights (destination) or live tensors (source)."""
        st = self._ws_state()
        if st.destination is not None:
            return dict(st.destination.checksums())
        return {name: hex_digest(checksum_tensor(t)) for name, t in sorted(st.tensors.items())}

    def ws_sha256(self) -> dict[str, str]:
        """sha256 of every live tensor's bytes: lets a checker verify without moving the bytes."""
        return {name: tensor_sha256(t) for name, t in self._ws_live().items()}

    def ws_tensor(self, name: str) -> torch.Tensor:
        """A CPU copy of one live tensor (verification, dumps)."""
        live = self._ws_live()
        if name not in live:
            raise ParticipantError(f"no tensor {name!r} on {self._ws_state().coord}")
        return live[name].detach().cpu().clone()

    # ---- process group --------------------------------------------------------------------

    def ws_join(
        self,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        group_name: str,
    ) -> bool:
        """Join (or keep) the sync process group. Returns True when an existing group was reused."""
        st = self._ws_state()
        key = (group_name, rank, world_size)
        if st.group is not None and st.group_key == key and st.group.healthy:
            return True
        self.ws_leave()
        st.group = SyncGroup.connect(
            store_host=store_host,
            store_port=store_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
            group_name=group_name,
        )
        st.group_key = key
        st.store = participant_txn.store_client(store_host, store_port, timeout_s)
        st.progress = ProgressWriter(st.store, group_name, rank)
        st.plans.clear()
        return False

    def ws_leave(self) -> None:
        st = self._ws_state()
        if st.group is not None:
            try:
                st.group.close()
            finally:
                st.group, st.group_key, st.progress, st.store = None, None, None, None
                st.plans.clear()

    # ---- one sync -------------------------------------------------------------------------

    def ws_run(
        self,
        plan: RankPlan | str,
        digest: str,
        version: str,
        config: TransferConfig,
        txn: str | None = None,
    ) -> RankResult:
        """Run this rank's whole plan for `version`. `plan` may be the digest of a plan sent before.

        Never raises: a failure comes back as the result's typed `failure`, so the coordinator
        can make the collective decision. `txn`: the commit record a destination prepares in.
        """
        st = self._ws_state()
        rank = st.group_key[1] if st.group_key else -1
        started = time.monotonic()
        try:
            rank_plan = self._ws_resolve_plan(plan, digest, rank)
            sources = None
            if st.destination is not None:
                self._ws_begin(version, config, txn)
            else:
                sources = snapshot(st.tensors, rank) if config.snapshot else st.tensors
            kept = st.kept if config.keep_sent else None
            result = run_rank_plan(
                st.group, rank_plan, sources=sources, destination=st.destination, config=config,
                on_progress=self._ws_progress, hooks=self._ws_hooks, kept=kept,
            )  # fmt: skip
            st.kept = kept_after(st.kept, config.keep_sent, result.ok, sources, version)
            if result.ok and st.destination is not None and st.txn is not None and st.record is not None:
                participant_txn.prepare(st.destination, st.record, st.txn, rank)
            return result
        except Exception as e:  # the coordinator needs a result, not a dead call
            failure = _failure(e, st.role, rank if rank >= 0 else None)
        return RankResult(rank, False, 0, 0, time.monotonic() - started, failure=failure)

    def _ws_begin(self, version: str, config: TransferConfig, txn: str | None) -> None:
        st = self._ws_state()
        assert st.destination is not None
        st.destination.set_policy(config.staging)  # type: ignore[arg-type]
        if config.staging == "inplace":
            st.serving = False  # live memory is about to be overwritten: the engine must not serve
        st.destination.begin(version)
        st.txn = LocalTxn(txn, version) if txn else None
        st.record = None
        if txn and st.store is not None:
            st.record = CommitRecord(st.store, txn)

    def _ws_resolve_plan(self, plan: RankPlan | str, digest: str, rank: int) -> RankPlan:
        st = self._ws_state()
        if st.group is None:
            raise ConnectError("ws_run before ws_join: no process group")
        if isinstance(plan, str):
            if plan not in st.plans:
                raise PlanMismatchError(f"plan {plan[:12]} is not cached on rank {rank}; send the plan")
            plan = st.plans[plan]
        if plan.digest != digest:
            raise PlanMismatchError(f"plan digest {plan.digest[:12]} != announced {digest[:12]}", rank=rank)
        if plan.rank != rank:
            raise PlanMismatchError(f"plan is for rank {plan.rank}, this participant joined as rank {rank}")
        st.plans = {digest: plan}
        return plan

    def _ws_progress(self, done_bytes: int, total_bytes: int) -> None:
        """Engine progress callback (after each round): a hook for subclasses, then the store."""
        self.ws_on_progress(done_bytes, total_bytes)
        st = self._ws_state()
        if st.progress is not None:
            st.progress.maybe_write(done_bytes, total_bytes)

    def ws_on_progress(self, done_bytes: int, total_bytes: int) -> None:
        """Called inside `ws_run` after each completed round (bytes sent + received so far)."""

    def ws_commit(self, version: str) -> str | None:
        """Apply `version` after the coordinator decided commit. A destination refuses a version
        other than the one it staged and prepared, and bytes that changed since it prepared."""
        st = self._ws_state()
        if st.destination is None:
            st.version = version
            return version
        with st.lock:
            return self._ws_commit_locked(st, version)

    def _ws_commit_locked(self, st: _State, version: str) -> str | None:
        assert st.destination is not None
        if st.serving:
            raise CommitFailed(f"commit {version!r} while this rank serves: pause its replica first")
        rank = st.group_key[1] if st.group_key else None
        if st.txn is None:  # a sync without a commit record (tests, tools): the staged version only
            if st.destination.pending_version != version:
                raise CommitFailed(
                    f"rank {rank}: commit {version!r}, staged is a different version", rank=rank
                )
            return st.destination.commit(version)
        if self._ws_before_commit is not None:
            self._ws_before_commit(st.destination)
        return participant_txn.commit(st.destination, st.record, st.txn, rank, version)

    def ws_abort(self) -> str | None:
        st = self._ws_state()
        if st.destination is not None:
            st.destination.abort()
            if st.txn is not None and st.txn.phase != "committed":
                st.txn.phase = "aborted"
        return self.ws_version()


def _failure(e: Exception, role: Role, rank: int | None) -> SyncFailure:
    """A WeightSyncError as it is; anything else is this side's own failure, in one line (the
    traceback goes to this process's log, never into the failure)."""
    if isinstance(e, WeightSyncError):
        return e.located(rank=rank).to_failure()
    log.exception("rank %s: ws_run failed unexpectedly", rank)
    kind = SourceError if role is Role.SOURCE else DestinationError
    return kind(f"rank {rank}: {describe_unexpected(e)}", rank=rank).to_failure()


def _placed(coord: RankCoord, tensors: Mapping[str, torch.Tensor]) -> RankCoord:
    """Fill node and device from where the actor really runs, unless the user set them."""
    import ray

    default = RankCoord(role=coord.role)
    node = coord.node if coord.node != default.node else ray.util.get_node_ip_address()
    device = coord.device
    if device == default.device and tensors:
        device = str(next(iter(tensors.values())).device)
    return dataclasses.replace(coord, node=node, device=device)
