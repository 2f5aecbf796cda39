"""Driving one transfer: every rank runs its plan concurrently; collect results, progress and
the root cause of a failure."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from sync_runtime.errors import InternalError, SyncFailure, SyncStep, TransferTimeout, WeightSyncError
from sync_runtime.runtime.calls import remote_error
from sync_runtime.runtime.discovery import Participant
from sync_runtime.runtime.session import Session
from sync_runtime.schema.crd import Transport
from sync_runtime.transfer import RankResult, TransferConfig, publish_failure


def deadline_margin(timeout_s: float) -> float:
    """Slack on top of the transfer timeout before the coordinator stops waiting for a rank:
    the engine's own per-step timeouts fire first and produce the better message."""
    return min(30.0, max(2.0, 0.25 * timeout_s))


POLL_S = 0.2
STRAGGLER_GRACE_S = 20.0
"""Once a rank failed, how long the others still get to return. A live rank sees the published
failure within its poll interval and aborts, so this only bounds the wait for a rank that cannot
answer: its process died without Ray noticing (a vLLM server's remote engine, whose head keeps
its HTTP routes waiting on it), where waiting out `transferTimeoutSeconds` (300 s by default)
would only delay the report. Such a rank is reported unfinished, and its replica out of serving."""


def backend_for(participants: Sequence[Participant], transport: Transport) -> str:
    if transport.backend != "auto":
        return transport.backend
    return "nccl" if all(p.meta.device.startswith("cuda") for p in participants) else "gloo"


def transfer_config(
    transport: Transport,
    participant: Participant,
    backend: str | None = None,
    staging: str | None = None,
    delta_base: Mapping[int, str] | None = None,
) -> TransferConfig:
    """`staging`: the rank's own policy (its deployment's), else transport.staging. `delta_base`:
    the destination ranks that take deltas this sync, and their base (runtime/delta_base.py)."""
    backend = backend or backend_for([participant], transport)
    device = participant.meta.device if backend == "nccl" else "cpu"
    return TransferConfig(
        backend=backend,
        timeout_s=float(transport.transfer_timeout_seconds),
        device=device,
        staging=staging or transport.staging,
        snapshot=transport.snapshot,
        wire_dtypes=participant.wire_dtypes,  # the destination rank's casts, found by discovery
        delta_base=tuple(sorted((delta_base or {}).items())),
        keep_sent=transport.delta == "auto" and backend == "gloo",
    )


@dataclass(frozen=True, slots=True)
class Transfer:
    """What one transfer came to: every rank's result, or the root cause of its failure."""

    results: list[RankResult]
    """By rank; empty when the transfer failed."""
    failure: SyncFailure | None = None
    unfinished: frozenset[int] = frozenset()
    """Ranks still inside ws_run: their calls queue behind it, so nobody waits on them."""


def drive_transfer(
    session: Session,
    transport: Transport,
    version: str,
    store: Any,
    on_progress: Callable[[int], None],
    txn: str | None = None,
    staging: Mapping[int, str] | None = None,
    delta_base: Mapping[int, str] | None = None,
) -> Transfer:
    """Run every rank's plan concurrently; all results, or the root cause of the failure.

    `staging`: destination rank -> its deployment's staging policy (default transport.staging)."""
    ps = session.participants
    keys = [f"{session.group_name}/progress/{rank}" for rank in range(len(ps))]
    for key in keys:
        store.delete_key(key)
    refs = _start_ranks(session, transport, version, txn, staging, delta_base)
    session.syncs += 1  # the engine numbers syncs per group from 1; keeps the coordinator in step
    margin = deadline_margin(transport.transfer_timeout_seconds)
    deadline = time.monotonic() + transport.transfer_timeout_seconds + margin
    results: dict[int, RankResult] = {}
    failures: list[SyncFailure] = []

    def fail(failure: SyncFailure) -> None:
        failures.append(failure)
        # Idempotent (first writer wins); covers ranks that died, hang, or failed before the
        # engine could publish their failure, so the others stop within one poll interval.
        mark_failed(store, session, session.syncs, failure)

    pending, reported, failed_at = list(refs), -1, None
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        for r in ready:
            outcome = _outcome(r, refs[r], ps[refs[r]])
            if outcome.ok:
                results[refs[r]] = outcome
            else:
                fail(_named(outcome, refs[r], ps))
        if failures and failed_at is None:
            failed_at = time.monotonic()
            deadline = min(deadline, failed_at + STRAGGLER_GRACE_S)
        done = _progress(store, keys, results)
        if done != reported:
            on_progress(done)
            reported = done
    # A rank still running when the others gave up on it explains their timeouts: it goes
    # first, so among failures of the same root-cause rank it is the one reported.
    if failed_at is None:
        hung = [_hung(refs[r], ps[refs[r]], transport.transfer_timeout_seconds, margin) for r in pending]
    else:
        hung = [_straggler(refs[r], ps[refs[r]], time.monotonic() - failed_at) for r in pending]
    for failure in hung:
        mark_failed(store, session, session.syncs, failure)
    failures = hung + failures
    if failures:
        root = min(failures, key=lambda f: f.root_cause)  # min keeps the first of equals
        return Transfer([], root, frozenset(refs[r] for r in pending))
    return Transfer([results[rank] for rank in range(len(ps))])


def _start_ranks(
    session: Session,
    transport: Transport,
    version: str,
    txn: str | None,
    staging: Mapping[int, str] | None,
    delta_base: Mapping[int, str] | None,
) -> dict[Any, int]:
    """Every rank's `ws_run`, started: its result ref -> the rank."""
    plan, ps = session.plan, session.participants
    backend = backend_for(ps, transport)
    refs: dict[Any, int] = {}
    # Every rank's own program, cut in batches in one pass (not rank by rank: planner/program.py)
    programs = None if session.plans_sent else plan.rank_plans(range(len(ps)))
    for rank, p in enumerate(ps):
        rank_plan = plan.digest if programs is None else next(programs)
        cfg = transfer_config(transport, p, backend, (staging or {}).get(rank), delta_base)
        refs[p.handle.ws_run.remote(rank_plan, plan.digest, version, cfg, txn)] = rank
    return refs


def _named(result: RankResult, rank: int, ps: Sequence[Participant]) -> SyncFailure:
    """The rank's failure, with the participant's name (what an operator looks for in Ray) and,
    when the failure is a peer's doing (a send to a dead worker broke), the peer's name too: a
    server's proxy is named after its pod, so a dead server's pod is named even when only the
    rank that talked to it could report the failure."""
    failure = result.failure or InternalError("ws_run failed without saying why").to_failure()
    message = f"{ps[rank].name}: {failure.message}"
    peer = failure.peer
    if peer is not None and peer != rank and 0 <= peer < len(ps):
        message += f" (peer: rank {peer}, {ps[peer].name})"
    return failure.model_copy(
        update={"rank": rank if failure.rank is None else failure.rank, "message": message}
    )


def _hung(rank: int, p: Participant, timeout_s: float, margin: float) -> SyncFailure:
    """Still running when the others gave up on it: the likely root cause."""
    return TransferTimeout(
        f"rank {rank} ({p.name}) did not finish within {timeout_s:g}s (+{margin:g}s margin)",
        rank=rank,
        step=SyncStep.TRANSFER,
    ).to_failure()


def _straggler(rank: int, p: Participant, waited_s: float) -> SyncFailure:
    """Still running well after another rank failed (which every live rank hears of within its
    poll interval): its process likely died unnoticed. Reported after the failure that caused it."""
    return TransferTimeout(
        f"rank {rank} ({p.name}) was still in its transfer {waited_s:.0f}s after the sync failed",
        rank=rank,
        step=SyncStep.TRANSFER,
    ).to_failure()


def _outcome(ref: Any, rank: int, p: Participant) -> RankResult:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as e:
        where = f"rank {rank} ({p.name}): ws_run"
        error: WeightSyncError = remote_error(e, where).located(rank=rank, step=SyncStep.TRANSFER)
        return RankResult(rank, False, 0, 0, 0.0, failure=error.to_failure())


def _progress(store: Any, keys: Sequence[str], results: dict[int, RankResult]) -> int:
    """Bytes moved so far. Ranks count sent + received bytes, so every byte is counted twice."""
    done = 0
    for rank, key in enumerate(keys):
        if rank in results:
            done += results[rank].recv_bytes + results[rank].send_bytes
        elif store.check([key]):
            raw = store.get(key)
            done += int((raw.decode() if isinstance(raw, bytes) else raw).partition("/")[0])
    return done // 2


def mark_failed(store: Any, session: Session, sync_id: int, failure: SyncFailure) -> None:
    """Publish a failure the failing rank cannot publish itself (it died or hangs), so the other
    ranks abort within one poll interval instead of waiting for their own timeouts.

    Idempotent: the first failure published for a sync wins (a rank's own report or this).
    """
    # Best effort: should the store fail, the ranks still stop at their own timeouts, and the
    # report names the cause from the coordinator's side anyway.
    with contextlib.suppress(Exception):
        publish_failure(
            store,
            group_name=session.group_name,
            world_size=len(session.participants),
            sync_id=sync_id,
            failure=failure,
        )
