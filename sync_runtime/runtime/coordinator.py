"""The coordinator: one sync end to end, from discovery to the collective commit.

One `Coordinator` lives as long as its WeightSync. A sync is: discover -> plan (cached while the
topology digest is unchanged) -> connect (the single process group, reused while healthy) ->
transfer (every rank runs its whole rank plan concurrently) -> verify -> commit or abort (a
two-phase commit with its record in the store, commit.py: commit on every destination only when
every rank prepared; each sync first finishes what an interrupted one left open). Every
blocking wait has a deadline; any failure is reported as the SyncFailure of a WeightSyncError
(reason, rank, step, peer, tensor), an unexpected exception as InternalError in one line (its
traceback goes to the log only).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import ray

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import Role
from sync_runtime.errors import (
    ConnectError,
    InternalError,
    PlanError,
    SyncFailure,
    SyncStep,
    VerifyFailed,
    WeightSyncError,
    describe_unexpected,
)
from sync_runtime.planner import PlannerConfig, plan_sync
from sync_runtime.runtime.calls import call_all
from sync_runtime.runtime.commit import (
    CommitHooks,
    Dest,
    begin_txn,
    destinations,
    open_store,
    recover,
    settle,
    two_phase_commit,
)
from sync_runtime.runtime.delta_base import DeltaSync, delta_bases, summary
from sync_runtime.runtime.discovery import DiscoveredSide, discover_all
from sync_runtime.runtime.drive import backend_for, drive_transfer
from sync_runtime.runtime.report_plan import plan_fields
from sync_runtime.runtime.session import Session
from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.report import (
    ProgressEvent,
    RankBytes,
    ReplicaState,
    ReplicaVersion,
    Reporter,
    StageSeconds,
    SyncReport,
    SyncResult,
)
from sync_runtime.transfer import CommitRecord

log = logging.getLogger("weightsync.coordinator")
MiB = 1 << 20


@dataclass(slots=True)
class _Attempt:
    """Mutable bookkeeping of one sync, turned into a SyncReport at the end."""

    version: str
    started_at: datetime
    stages: StageSeconds = dataclasses.field(default_factory=StageSeconds)
    planned_bytes: int = 0
    moved_bytes: int = 0
    ranks: list[RankBytes] = dataclasses.field(default_factory=list)
    plan: SyncPlan | None = None
    plan_cached: bool = False
    replicas: list[ReplicaVersion] = dataclasses.field(default_factory=list)
    recovered: list[str] = dataclasses.field(default_factory=list)
    dests: list[Dest] = dataclasses.field(default_factory=list)
    delta: DeltaSync = dataclasses.field(default_factory=DeltaSync)


class Coordinator:
    """Drives the syncs of one WeightSync, from a process connected to the participants' Ray cluster."""

    def __init__(
        self,
        spec: WeightSyncSpec,
        reporter: Reporter,
        *,
        advertise_host: str | None = None,
        manifest: Manifest | None = None,
        store_address: tuple[str, int] | None = None,
        commit_hooks: CommitHooks | None = None,
    ) -> None:
        """`store_address`: join a TCPStore hosted elsewhere instead of hosting one, so the commit
        record outlives this coordinator (a restarted one recovers from it). `commit_hooks`: tests."""
        self.spec = spec
        self.store_address = store_address
        self.commit_hooks = commit_hooks
        self.reporter = reporter
        self.advertise_host = advertise_host
        self._manifest = manifest
        self._session: Session | None = None
        self._store = None
        self._generation = 0
        # Group names must never repeat across coordinator instances: a participant still holding
        # a healthy group of a previous (restarted) runtime would otherwise "reuse" a group whose
        # store died with that runtime.
        self._instance = uuid.uuid4().hex[:8]

    def update_spec(self, spec: WeightSyncSpec) -> None:
        """A new desired state; the next sync rediscovers (and replans if the topology changed)."""
        self.spec = spec

    # ---- public ---------------------------------------------------------------------------

    def sync(self, version: str | None = None, *, skip_if_current: bool = False) -> SyncReport:
        """One sync of `version` (default: spec.version). Never raises for sync failures."""
        att = _Attempt(version=version or self.spec.version, started_at=datetime.now(UTC))
        try:
            report = self._sync(att, skip_if_current)
        except WeightSyncError as e:
            if e.step in (SyncStep.CONNECT, SyncStep.TRANSFER, SyncStep.VERIFY, SyncStep.COMMIT):
                self._invalidate_group()
            report = self._report(att, e.to_failure())
        except Exception as e:  # a bug or an unexpected Ray error: report it, keep the loop alive
            log.exception("sync %s failed unexpectedly", att.version)
            self._invalidate_group()
            report = self._report(att, InternalError(describe_unexpected(e)).to_failure())
        self.reporter.finished(report)
        return report

    def close(self) -> None:
        """Leave the process group on every participant (best effort) and drop the store."""
        session, self._session = self._session, None
        if session is not None and session.joined:
            call_all(
                [(p, "ws_leave", ()) for p in session.participants],
                timeout_s=10.0,
                step=SyncStep.CONNECT,
                raise_on_error=False,
            )
        self._store = None

    @property
    def session(self) -> Session | None:
        return self._session

    # ---- stages ---------------------------------------------------------------------------

    def _sync(self, att: _Attempt, skip_if_current: bool) -> SyncReport:
        self._emit(att, SyncStep.DISCOVER)
        t = time.monotonic()
        manifest, sides, digest = discover_all(self.spec, self._manifest, self._meta_timeout())
        att.stages.discover = time.monotonic() - t
        att.dests = destinations(sides)
        self._ensure_store()
        att.replicas, att.recovered = recover(att.dests, self._store, self._rpc_timeout())
        # After recovery: what the replicas hold now (it may have rolled a commit forward).
        if skip_if_current and all(
            r.version == att.version and r.state is ReplicaState.SERVING for r in att.replicas
        ):
            # Already there (e.g. a runtime restart): report success without moving a byte.
            return self._report(att, None)
        self._emit(att, SyncStep.PLAN)
        t = time.monotonic()
        session = self._plan(manifest, sides, digest, att)
        att.stages.plan = time.monotonic() - t
        self._emit(att, SyncStep.CONNECT)
        t = time.monotonic()
        self._connect(session)
        att.stages.connect = time.monotonic() - t
        backend = backend_for(session.participants, self.spec.transport)
        kept = [p.meta.kept_version for p in session.participants if p.meta.role is Role.SOURCE]
        att.delta.base = delta_bases(self.spec, att.dests, att.replicas, backend, session.plan.relay, kept)
        reconnect = lambda: self._invalidate_group() or self._connect(session)  # noqa: E731 (both run)
        results = att.delta.transfer(lambda: self._transfer(session, att), reconnect)
        self._verify(session, att, results)
        self._emit(att, SyncStep.COMMIT)
        t = time.monotonic()
        record = CommitRecord(self._store, session.txn)
        att.replicas, failure = two_phase_commit(
            att.dests, att.version, record, self._rpc_timeout(), self.commit_hooks
        )
        att.stages.commit = time.monotonic() - t
        return self._report(att, failure)

    def _plan(
        self, manifest: Manifest, sides: Sequence[DiscoveredSide], digest: str, att: _Attempt
    ) -> Session:
        if self._session is not None and self._session.topology_digest == digest:
            # Same actors (the digest covers actor ids); take their fresh metas (group health).
            self._session.participants = tuple(p for s in sides for p in s.participants)
            att.plan, att.plan_cached = self._session.plan, True
            att.planned_bytes = _plan_bytes(self._session.plan)
            return self._session
        if self._session is not None:
            self.close()  # topology changed: the old group spans the wrong ranks
        tr = self.spec.transport
        config = PlannerConfig(
            bucket_bytes=tr.bucket_mb * MiB,
            staging_budget_bytes=tr.staging_budget_mb * MiB,
            max_fan_in=tr.max_fan_in,
            relay=tr.relay,
        )
        try:
            plan = plan_sync(manifest, sides[0].side_spec(), [s.side_spec() for s in sides[1:]], config)
        except WeightSyncError:
            raise  # the planner's own kinds (PlanError, TopologyError, LayoutError) say what is wrong
        except ValueError as e:  # a bare one from a check below the planner: still a plan failure
            raise PlanError(str(e)) from e
        participants = tuple(p for s in sides for p in s.participants)
        if len(plan.ranks) != len(participants) or any(
            c.key != p.meta.coord.key for c, p in zip(plan.ranks, participants, strict=False)
        ):
            raise PlanError("planner returned ranks in another order than the participants")
        self._generation += 1
        self._session = Session(
            topology_digest=digest,
            plan=plan,
            participants=participants,
            group_name=self._group_name(plan),
        )
        att.plan, att.planned_bytes = plan, _plan_bytes(plan)
        return self._session

    def _connect(self, session: Session) -> None:
        healthy = all(
            p.meta.group_name == session.group_name and p.meta.group_healthy for p in session.participants
        )
        if session.joined and healthy:
            return
        if session.joined:  # some participant lost the group: start a fresh one under a new name
            self._generation += 1
            session.group_name = self._group_name(session.plan)
            session.joined = session.plans_sent = False
        session.syncs = 0
        host, port = self._ensure_store()
        tr, world = self.spec.transport, len(session.participants)
        backend = backend_for(session.participants, tr)
        calls = [
            (
                p,
                "ws_join",
                (host, port, rank, world, backend, float(tr.connect_timeout_seconds), session.group_name),
            )
            for rank, p in enumerate(session.participants)
        ]
        call_all(
            calls,
            timeout_s=tr.connect_timeout_seconds + 10.0,
            step=SyncStep.CONNECT,
            ranks=list(range(world)),
            error=ConnectError,
        )
        session.joined = True

    def _transfer(self, session: Session, att: _Attempt) -> list:
        self._emit(att, SyncStep.TRANSFER)
        t = time.monotonic()
        staging = {d.rank: self.spec.staging_of(d.deployment) for d in att.dests}
        session.txn = begin_txn(att.dests, staging, self._rpc_timeout())
        out = drive_transfer(
            session, self.spec.transport, att.version, self._store, self._progress_sink(att), session.txn,
            staging, att.delta.base,
        )  # fmt: skip
        att.stages.transfer = time.monotonic() - t
        if out.failure is not None:
            self._abort_all(session, att, skip=out.unfinished)
            raise WeightSyncError.from_failure(out.failure)
        results = out.results
        session.plans_sent = True
        for rank, (r, p) in enumerate(zip(results, session.participants, strict=True)):
            row = {"send_bytes": r.send_bytes, "recv_bytes": r.recv_bytes}
            att.ranks.append(RankBytes(rank=rank, role=p.meta.role.value, name=p.name, **row))
        att.moved_bytes = sum(r.recv_bytes for r in results)
        att.delta.report = summary(results, att.dests, att.delta.base)
        return results

    def _verify(self, session: Session, att: _Attempt, results: list) -> None:
        """Every rank received exactly what the plan says (the engine checked checksums per tensor)."""
        self._emit(att, SyncStep.VERIFY)
        t = time.monotonic()
        expected = [0] * len(session.participants)
        for rnd in session.plan.rounds:
            for b in rnd.buckets:
                expected[b.dst_rank] += b.nbytes
        for rank, r in enumerate(results):
            if r.recv_bytes != expected[rank]:
                self._abort_all(session, att)
                raise VerifyFailed(
                    f"rank {rank} ({session.participants[rank].name}) received "
                    f"{r.recv_bytes} bytes, the plan says {expected[rank]}",
                    rank=rank,
                )
        att.stages.verify = time.monotonic() - t

    # ---- helpers --------------------------------------------------------------------------

    def _abort_all(self, session: Session, att: _Attempt, skip: frozenset[int] = frozenset()) -> None:
        """Drop staging on every destination that answers, then report each replica (an in-place
        one is poisoned now). A rank still stuck in ws_run is not waited for: it never commits by
        itself (only after a commit decision), and the failure flag ends its run; its replica is
        reported out of serving, its version unknown (e.g. a data-parallel server whose remote
        node died: the head's call for every DP rank waits on the dead engine)."""
        dst = [
            p
            for rank, p in enumerate(session.participants)
            if p.meta.role is Role.DESTINATION and rank not in skip
        ]
        for rank in skip:
            session.participants[rank].handle.ws_abort.remote()  # runs after its ws_run returns
        call_all(
            [(p, "ws_abort", ()) for p in dst],
            timeout_s=self._rpc_timeout(),
            step=SyncStep.COMMIT,
            raise_on_error=False,
        )
        att.replicas = settle(att.dests, self._rpc_timeout(), unanswered=skip)

    def _invalidate_group(self) -> None:
        if self._session is not None:
            self._session.joined = False
            self._session.plans_sent = False
            self._session.syncs = 0
            self._generation += 1
            self._session.group_name = self._group_name(self._session.plan)

    def _group_name(self, plan: SyncPlan) -> str:
        # Every store key lives under this name: the random part keeps a client that can reach the
        # store's port but was not handed the name (over the Ray connection) out of the sync's keys.
        import secrets

        return f"ws-{plan.digest[:10]}-{self._instance}-g{self._generation}-{secrets.token_hex(16)}"

    def _ensure_store(self) -> tuple[str, int]:
        host = self.advertise_host or os.environ.get("POD_IP") or ray.util.get_node_ip_address()
        if self.store_address is not None:
            host = self.store_address[0]
        if self._store is None:
            timeout = float(self.spec.transport.connect_timeout_seconds)
            self._store = open_store(host, timeout, self.store_address)
        return host, self._store.port

    def _meta_timeout(self) -> float:
        return float(self.spec.transport.connect_timeout_seconds)

    def _rpc_timeout(self) -> float:
        return min(60.0, float(self.spec.transport.transfer_timeout_seconds)) + 5.0

    def _emit(self, att: _Attempt, step: SyncStep, done: int = 0) -> None:
        rounds = len(att.plan.rounds) if att.plan else 0
        self.reporter.progress(
            ProgressEvent(
                version=att.version, step=step, done_bytes=done, total_bytes=att.planned_bytes, rounds=rounds
            )
        )

    def _progress_sink(self, att: _Attempt):
        return lambda done: self._emit(att, SyncStep.TRANSFER, done)

    def _report(self, att: _Attempt, failure: SyncFailure | None) -> SyncReport:
        end = datetime.now(UTC)
        seconds = (end - att.started_at).total_seconds()
        plan = att.plan
        return SyncReport(
            version=att.version,
            started_at=att.started_at,
            finished_at=end,
            result=SyncResult.FAILED if failure else SyncResult.SUCCEEDED,
            failure=failure,
            planned_bytes=att.planned_bytes,
            moved_bytes=att.moved_bytes,
            seconds=seconds,
            throughput_bytes_per_second=att.moved_bytes / att.stages.transfer if att.stages.transfer else 0.0,
            stages=att.stages,
            ranks=att.ranks,
            plan_cached=att.plan_cached,
            **plan_fields(plan),
            replicas=att.replicas,
            recovered=att.recovered,
            **att.delta.fields(),
        )


def _plan_bytes(plan: SyncPlan) -> int:
    return sum(b.nbytes for r in plan.rounds for b in r.buckets)


__all__ = ["Coordinator", "Session"]
