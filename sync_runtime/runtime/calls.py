"""Concurrent remote calls on participants, each wait bounded by a deadline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from sync_runtime.errors import (
    ParticipantDied,
    RemoteCallFailed,
    SyncStep,
    WeightSyncError,
    describe_unexpected,
)
from sync_runtime.runtime.discovery import Participant


def call_all(
    calls: Sequence[tuple[Participant, str, tuple]],
    *,
    timeout_s: float,
    step: SyncStep,
    ranks: Sequence[int] | None = None,
    error: type[WeightSyncError] = RemoteCallFailed,
    raise_on_error: bool = True,
) -> list[Any]:
    """Call `method(*args)` on every participant concurrently; wait at most `timeout_s` in all.

    A call that fails raises `error` (ParticipantDied when the actor is gone, the participant's
    own WeightSyncError when it raised one), located at the rank and `step`; with
    raise_on_error=False its result is None instead.
    """
    refs = [getattr(p.handle, method).remote(*args) for p, method, args in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out: list[Any] = []
    for i, ((p, method, _), r) in enumerate(zip(calls, refs, strict=True)):
        rank = ranks[i] if ranks is not None else None
        where = f"{method} on {p.name}" + (f" (rank {rank})" if rank is not None else "")
        if r not in done:
            if raise_on_error:
                raise error(f"{where}: no answer within {timeout_s:g}s", rank=rank, step=step)
            out.append(None)
            continue
        try:
            out.append(ray.get(r))
        except ray.exceptions.RayError as e:
            if raise_on_error:
                raise remote_error(e, where, error).located(rank=rank, step=step) from e
            out.append(None)
    return out


def remote_error(
    e: ray.exceptions.RayError, where: str, error: type[WeightSyncError] = RemoteCallFailed
) -> WeightSyncError:
    """The typed error of a failed remote call: the participant's own when it raised one."""
    cause = getattr(e, "cause", None)  # RayTaskError keeps the exception the method raised
    if isinstance(cause, WeightSyncError):
        f = cause
        return type(f)(f"{where}: {f.message}", rank=f.rank, step=f.step, tensor=f.tensor, peer=f.peer)
    if isinstance(e, ray.exceptions.RayActorError):
        return ParticipantDied(f"{where}: the participant died ({describe_unexpected(e)})")
    return error(f"{where}: {describe_unexpected(e)}")
