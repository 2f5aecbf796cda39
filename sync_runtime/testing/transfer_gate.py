"""Holding a real transfer open at a known point, so that a test can act on it mid-transfer.

`SourceGate` parks every source rank of the next transfer right before a chosen round (the
engine's `before_round` test observer, set as the participant's `_ws_hooks` with
`__ray_call__`, so the sources' own classes are used unchanged). The rounds before it have
then been sent in full and the rounds from it on have not started, whatever the machine's
speed: a fault injected while the sources are parked lands in the middle of the transfer, not
in a race with a transfer that takes milliseconds. A parked rank touches a marker file, so the
test knows when every source is there; the gate stays closed while its file exists (bounded by
`max_wait_s`, so that a test that never opens it cannot hang the sources).

`messages_to` counts the messages a rank receives in one round (a rank reports its progress
per completed message, so a test that reads a receiver's progress must know how many);
`wait_received` reads that progress from the running sync's store; `replica_rank` and
`bytes_per_round` find a replica's rank and what it receives in each round.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import Role
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.transfer import EngineHooks, TransferConfig
from sync_runtime.transfer.buffers import message_layout


def _arm(instance: Any, gate: str, round_index: int, max_wait_s: float) -> bool:
    """Runs inside a participant actor: park its next transfers before `round_index` while
    `gate` exists."""

    def hold(i: int) -> None:
        if i != round_index or not os.path.exists(gate):
            return
        Path(f"{gate}.{os.getpid()}.reached").touch()  # this rank sent every earlier round
        deadline = time.monotonic() + max_wait_s
        while os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    instance._ws_hooks = EngineHooks(before_round=hold)
    return True


def _disarm(instance: Any) -> bool:
    instance._ws_hooks = None
    return True


class SourceGate:
    """A closed gate before round `round_index` of the next transfers of `actors` (see module doc).

    The actors and the test must share a file system (one host: the local Ray cluster)."""

    def __init__(
        self, actors: Sequence[Any], directory: Path, round_index: int, max_wait_s: float = 90.0
    ) -> None:
        self.actors, self.round_index = list(actors), round_index
        self.path = directory / "gate"
        self.path.touch()
        ray.get([a.__ray_call__.remote(_arm, str(self.path), round_index, max_wait_s) for a in self.actors])

    def parked(self) -> int:
        """How many ranks have reached the gate so far."""
        return len(list(self.path.parent.glob(f"{self.path.name}.*.reached")))

    def wait_parked(self, timeout_s: float, unless: Callable[[], bool] | None = None) -> None:
        """Until every actor's rank is parked at the gate; fails early once `unless()` holds
        (e.g. the sync ended before its transfer reached the gate)."""
        deadline = time.monotonic() + timeout_s
        while self.parked() < len(self.actors):
            if time.monotonic() > deadline or (unless is not None and unless()):
                raise TimeoutError(
                    f"{self.parked()} of {len(self.actors)} sources reached round {self.round_index} "
                    f"within {timeout_s:g}s"
                )
            time.sleep(0.05)

    def open(self) -> None:
        self.path.unlink(missing_ok=True)

    def remove(self) -> None:
        """Open the gate and take the observer off every actor (the sources may be shared)."""
        self.open()
        ray.get([a.__ray_call__.remote(_disarm) for a in self.actors])


def replica_rank(participants: Sequence[Any], replica: int) -> int:
    """The global rank of `replica`'s first destination rank among a session's `participants`."""
    return next(
        rank
        for rank, p in enumerate(participants)
        if p.meta.role is Role.DESTINATION and p.meta.coord.replica == replica
    )


def bytes_per_round(plan: SyncPlan, rank: int) -> list[int]:
    """The bytes `rank` receives in each round of `plan`."""
    return [sum(b.nbytes for b in r.buckets if b.dst_rank == rank) for r in plan.rounds]


def messages_to(plan: SyncPlan, rank: int, round_index: int) -> int:
    """Messages `rank` receives in round `round_index` of `plan` under the default message format
    (TransferConfig.direct_min_bytes, transfer/buffers.py `message_layout`)."""
    direct_min = TransferConfig().direct_min_bytes
    buckets = [b for b in plan.rounds[round_index].buckets if b.dst_rank == rank]
    return sum(message_layout(b, direct_min).count for b in buckets)


def received_bytes(coordinator: Coordinator, rank: int) -> int:
    """The bytes `rank` (a destination: it sends none) reported received in the running sync: its
    progress key in the coordinator's store (runtime/drive.py). A rank writes it on its first
    completed message, then at most every PROGRESS_INTERVAL_S (runtime/participant_txn.py)."""
    session, store = coordinator.session, coordinator._store
    assert session is not None and store is not None
    key = f"{session.group_name}/progress/{rank}"
    if not store.check([key]):
        return 0
    return int(bytes(store.get(key)).decode().partition("/")[0])


def wait_received(coordinator: Coordinator, rank: int, nbytes: int, timeout_s: float) -> int:
    """Until `rank` reported `nbytes` received (or the timeout); what it reported."""
    deadline = time.monotonic() + timeout_s
    while (got := received_bytes(coordinator, rank)) < nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    return got
