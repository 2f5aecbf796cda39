"""Driving one transfer: every rank runs its plan concurrently; collect results, progress and
the root cause of a failure."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from sync_runtime.core.topology import Role
from sync_runtime.runtime.calls import first_line
from sync_runtime.runtime.discovery import Participant
from sync_runtime.runtime.failures import StepFailed
from sync_runtime.runtime.session import Session
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncFailure, SyncStep
from sync_runtime.transfer import RankResult, TransferConfig, publish_failure

POLL_S = 0.2


def deadline_margin(timeout_s: float) -> float:
    """Slack on top of the transfer timeout before the coordinator stops waiting for a rank:
    the engine's own per-step timeouts fire first and produce the better message."""
    return min(30.0, max(2.0, 0.25 * timeout_s))


POLL_S = 0.2


def backend_for(participants: Sequence[Participant], transport: Transport) -> str:
    if transport.backend != "auto":
        return transport.backend
    return "nccl" if all(p.meta.device.startswith("cuda") for p in participants) else "gloo"


def transfer_config(
    transport: Transport, participant: Participant, backend: str | None = None
) -> TransferConfig:
    backend = backend or backend_for([participant], transport)
    device = participant.meta.device if backend == "nccl" else "cpu"
    return TransferConfig(backend=backend, timeout_s=float(transport.transfer_timeout_seconds), device=device)


def drive_transfer(
    session: Session,
    transport: Transport,
    version: str,
    store: Any,
    on_progress: Callable[[int], None],
) -> list[RankResult]:
    """Run every rank's plan concurrently; return all results or raise StepFailed with the root cause."""
    plan, ps = session.plan, session.participants
    backend = backend_for(ps, transport)
    keys = [f"{session.group_name}/progress/{rank}" for rank in range(len(ps))]
    for key in keys:
        store.delete_key(key)
    refs: dict[Any, int] = {}
    for rank, p in enumerate(ps):
        rank_plan = plan.digest if session.plans_sent else plan.for_rank(rank)
        cfg = transfer_config(transport, p, backend)
        refs[p.handle.ws_run.remote(rank_plan, plan.digest, version, cfg)] = rank
    session.syncs += 1  # the engine numbers syncs per group from 1; keeps the coordinator in step
    margin = deadline_margin(transport.transfer_timeout_seconds)
    deadline = time.monotonic() + transport.transfer_timeout_seconds + margin
    results: dict[int, RankResult] = {}
    failures: list[tuple[int, SyncFailure]] = []

    def fail(priority: int, failure: SyncFailure) -> None:
        failures.append((priority, failure))
        # Idempotent (first writer wins); covers ranks that died, hang, or failed before the
        # engine could publish their failure, so the others stop within one poll interval.
        mark_failed(store, session, session.syncs, failure, transport.transfer_timeout_seconds)

    pending, reported = list(refs), -1
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        for r in ready:
            outcome = _outcome(r, refs[r], ps[refs[r]])
            if isinstance(outcome, SyncFailure):
                fail(_priority(outcome), outcome)
            else:
                results[refs[r]] = outcome
        done = _progress(store, keys, results)
        if done != reported:
            on_progress(done)
            reported = done
    for r in pending:
        fail(2, _hung(refs[r], ps[refs[r]], transport.transfer_timeout_seconds, margin))
    if failures:
        raise StepFailed(min(failures, key=lambda f: f[0])[1], frozenset(refs[r] for r in pending))
    return [results[rank] for rank in range(len(ps))]


def _hung(rank: int, p: Participant, timeout_s: float, margin: float) -> SyncFailure:
    """Still running when the others gave up on it: the likely root cause (priority 2)."""
    return SyncFailure(
        reason="TransferTimeout",
        rank=rank,
        step=SyncStep.TRANSFER,
        message=f"rank {rank} ({p.name}) did not finish within {timeout_s:g}s (+{margin:g}s margin)",
    )


def _outcome(ref: Any, rank: int, p: Participant) -> RankResult | SyncFailure:
    try:
        result: RankResult = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        return SyncFailure(
            reason="ParticipantDied",
            rank=rank,
            step=SyncStep.TRANSFER,
            message=f"rank {rank} ({p.name}) died during the transfer: {first_line(e)}",
        )
    except ray.exceptions.RayError as e:
        return SyncFailure(
            reason="RemoteCallFailed",
            rank=rank,
            step=SyncStep.TRANSFER,
            message=f"rank {rank} ({p.name}): ws_run failed: {first_line(e)}",
        )
    if result.ok:
        return result
    return SyncFailure(
        reason=_reason(result, p),
        rank=rank,
        step=_step(result.step),
        message=f"rank {rank} ({p.name}): {(result.error or '').strip()[:2000]}",
    )


def _reason(result: RankResult, p: Participant) -> str:
    error = result.error or ""
    if "peer rank" in error and "failed" in error:
        return "PeerFailed"
    if result.step == "verify" or "checksum" in error.lower():
        return "ChecksumMismatch"
    if result.step == "plan":
        return "PlanMismatch"
    if "timed out" in error or "Timeout" in error:
        return "TransferTimeout"
    return "SourceError" if p.meta.role is Role.SOURCE else "DestinationError"


def _priority(failure: SyncFailure) -> int:
    """Root cause first: a death or a rank's own error explains the peers' aborts and timeouts."""
    return {"ParticipantDied": 0, "TransferTimeout": 3, "PeerFailed": 4}.get(failure.reason, 1)


def _step(step: str | None) -> SyncStep:
    try:
        return SyncStep(step or "transfer")
    except ValueError:
        return SyncStep.TRANSFER


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


def mark_failed(store: Any, session: Session, sync_id: int, failure: SyncFailure, timeout_s: float) -> None:
    """Publish a failure the failing rank cannot publish itself (it died or hangs), so the other
    ranks abort within one poll interval instead of waiting for their own timeouts.

    Idempotent: the first failure published for a sync wins (a rank's own report or this).
    `timeout_s` is unused (the store's own timeout applies); kept for the callers.
    """
    # Best effort: should the store fail, the ranks still stop at their own timeouts, and the
    # report names the cause from the coordinator's side anyway.
    with contextlib.suppress(Exception):
        publish_failure(
            store,
            group_name=session.group_name,
            world_size=len(session.participants),
            sync_id=sync_id,
            rank=failure.rank if failure.rank is not None else -1,
            message=f"[coordinator] {failure.reason}: {failure.message}",
        )
