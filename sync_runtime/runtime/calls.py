"""Concurrent remote calls on participants, each wait bounded by a deadline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from sync_runtime.runtime.discovery import Participant
from sync_runtime.runtime.failures import StepFailed
from sync_runtime.schema.report import SyncFailure, SyncStep


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
                        message=f"{where}: {first_line(e)}",
                    )
                ) from e
            out.append(None)
    return out


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]
