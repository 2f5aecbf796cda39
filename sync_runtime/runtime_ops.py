"""The coordinator's I/O with Ray: connecting, discovery of all sides, concurrent remote calls
with deadlines, and driving one transfer while collecting results and progress.

Kept apart from coordinator.py so the sync's stage logic reads top to bottom there; everything
here talks to Ray and turns its errors into a `SyncFailure` naming the rank, actor and step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray

from sync_runtime import crd
from sync_runtime.crd import Transport, WeightSyncSpec
from sync_runtime.discovery import (
    DiscoveredSide,
    DiscoveryError,
    Participant,
    TopologyMismatchError,
    check_side,
    gather,
    topology_digest,
)
from sync_runtime.layouts import LayoutError
from sync_runtime.manifest import Manifest
from sync_runtime.models import ModelConfigError, build_manifest, load_model_config
from sync_runtime.report import SyncFailure, SyncStep
from sync_runtime.topology import Role
from sync_runtime.transfer import RankResult, TransferConfig, publish_failure

if TYPE_CHECKING:
    from sync_runtime.coordinator import Session


def deadline_margin(timeout_s: float) -> float:
    """Slack on top of the transfer timeout before the coordinator stops waiting for a rank:
    the engine's own per-step timeouts fire first and produce the better message."""
    return min(30.0, max(2.0, 0.25 * timeout_s))


POLL_S = 0.2


class StepFailed(Exception):
    """A sync stage failed; carries the report's failure."""

    def __init__(self, failure: SyncFailure, unfinished: frozenset[int] = frozenset()) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.unfinished = unfinished
        """Ranks still inside a remote call: their calls queue behind it, so nobody waits on them."""


class RayFailure(RuntimeError):
    """Cannot connect to the participants' Ray cluster."""


# ---- Ray connection ------------------------------------------------------------------------


def resolve_address(spec: WeightSyncSpec, namespace: str | None = None) -> str | None:
    """The one Ray address of all deployments (None when they disagree or name none)."""
    namespace = namespace or os.environ.get("POD_NAMESPACE", "default")
    try:
        addresses = {crd.resolve_ray_address(r, namespace) for r in spec.deployments()}
    except ValueError:
        return None
    return addresses.pop() if len(addresses) == 1 else None


def connect_ray(spec: WeightSyncSpec, namespace: str | None = None) -> str:
    """Connect this process to the one Ray cluster all deployments live in (once per process).

    Returns the resolved address; a process already connected (the demo's driver) is reused.
    """
    namespace = namespace or os.environ.get("POD_NAMESPACE", "default")
    refs = spec.deployments()
    try:
        addresses = [crd.resolve_ray_address(r, namespace) for r in refs]
    except ValueError as e:
        raise RayFailure(str(e)) from e
    if len(set(addresses)) != 1:
        listed = ", ".join(f"{r.name}={a}" for r, a in zip(refs, addresses, strict=True))
        raise RayFailure(f"all deployments must share one Ray cluster; got {listed}")
    address = addresses[0]
    if ray.is_initialized():
        return address
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except Exception as e:  # ray.init raises ConnectionError, ValueError, RuntimeError...
        raise RayFailure(f"cannot connect to Ray at {address}: {type(e).__name__}: {_first_line(e)}") from e
    return address


def ray_token_from_env() -> str | None:
    """The Ray auth token the operator mounted (`crd.ray_token_env_name`), source's first.

    All deployments share one cluster, hence one token. Never logged.
    """
    for index in range(crd.MAX_DESTINATIONS + 1):
        value = os.environ.get(crd.ray_token_env_name(index), "").strip()
        if value:
            return value
    return None


def ensure_ray_auth_env(argv: Sequence[str]) -> None:
    """Make Ray see the mounted token, the documented way: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN
    in the environment *before* Ray is imported (Ray caches its auth config at import time).

    When Ray is already imported (the CLI imports it with the coordinator), re-execute the same
    command with the variables set; the token travels in the environment, never in argv.
    """
    token = ray_token_from_env()
    if not token or (
        os.environ.get("RAY_AUTH_TOKEN") == token and os.environ.get("RAY_AUTH_MODE") == "token"
    ):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    if "ray" in sys.modules:
        os.execv(sys.executable, [sys.executable, *argv])


# ---- discovery -----------------------------------------------------------------------------


def discover_all(
    spec: WeightSyncSpec,
    manifest: Manifest | None,
    timeout_s: float,
) -> tuple[Manifest, list[DiscoveredSide], str]:
    """Source first, then each destination; everything checked before a byte moves."""
    try:
        found = [gather(spec.source, timeout_s)] + [gather(d, timeout_s) for d in spec.destinations]
        manifest = manifest or _manifest(spec, found[0])
        roles = [Role.SOURCE] + [Role.DESTINATION] * len(spec.destinations)
        refs = [spec.source, *spec.destinations]
        sides = [
            check_side(ref, role, ps, manifest) for ref, role, ps in zip(refs, roles, found, strict=True)
        ]
    except TopologyMismatchError as e:
        raise StepFailed(
            SyncFailure(reason="TopologyMismatch", message=str(e), step=SyncStep.DISCOVER)
        ) from e
    except (LayoutError, ModelConfigError) as e:
        raise StepFailed(SyncFailure(reason="InvalidLayout", message=str(e), step=SyncStep.DISCOVER)) from e
    except DiscoveryError as e:
        raise StepFailed(SyncFailure(reason="DiscoveryFailed", message=str(e), step=SyncStep.DISCOVER)) from e
    return manifest, sides, topology_digest(manifest, sides)


def _manifest(spec: WeightSyncSpec, sources: Sequence[Participant]) -> Manifest:
    if spec.model:
        return build_manifest(load_model_config(spec.model))
    configs = [p.meta.model_config for p in sources if p.meta.model_config]
    if not configs:
        raise DiscoveryError(
            "spec.model is not set and no source actor reports a model config (ws_init model_config)"
        )
    return build_manifest(configs[0])


# ---- remote calls --------------------------------------------------------------------------


def call_all(
    calls: Sequence[tuple[Participant, str, tuple]],
    *,
    timeout_s: float,
    step: SyncStep,
    ranks: Sequence[int] | None = None,
    reason: str = "RemoteCallFailed",
    raise_on_error: bool = True,
) -> list[Any]:
    """Call `method(*args)` on every participant concurrently; wait at most `timeout_s` in all."""
    refs = [getattr(p.handle, method).remote(*args) for p, method, args in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out: list[Any] = []
    for i, ((p, method, _), r) in enumerate(zip(calls, refs, strict=True)):
        rank = ranks[i] if ranks is not None else None
        where = f"{method} on {p.name}" + (f" (rank {rank})" if rank is not None else "")
        if r not in done:
            if raise_on_error:
                raise StepFailed(
                    SyncFailure(
                        reason=reason,
                        rank=rank,
                        step=step,
                        message=f"{where}: no answer within {timeout_s:g}s",
                    )
                )
            out.append(None)
            continue
        try:
            out.append(ray.get(r))
        except ray.exceptions.RayError as e:
            if raise_on_error:
                died = isinstance(e, ray.exceptions.RayActorError)
                raise StepFailed(
                    SyncFailure(
                        reason="ParticipantDied" if died else reason,
                        rank=rank,
                        step=step,
                        message=f"{where}: {_first_line(e)}",
                    )
                ) from e
            out.append(None)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]


# ---- transfer ------------------------------------------------------------------------------


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
            message=f"rank {rank} ({p.name}) died during the transfer: {_first_line(e)}",
        )
    except ray.exceptions.RayError as e:
        return SyncFailure(
            reason="RemoteCallFailed",
            rank=rank,
            step=SyncStep.TRANSFER,
            message=f"rank {rank} ({p.name}): ws_run failed: {_first_line(e)}",
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
