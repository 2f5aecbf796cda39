"""Execute one rank's part of a plan: pack, send, receive, unpack, verify; double-buffered.

Per round i the rank posts every receive and send of the round, then, while they are in flight,
packs round i+1's send buffers; once round i completed it posts round i+1 and unpacks round i's
receives while round i+1 is in flight. At most two rounds of buffers are alive at any time,
which is the staging budget the planner assumes. A relay rank that forwards what it received
packs round i+1 only after round i was unpacked (its source bytes arrive in round i).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from sync_runtime.plan import Bucket, RankPlan
from sync_runtime.transfer import testing
from sync_runtime.transfer.buffers import empty_message, pack_bucket, unpack_bucket
from sync_runtime.transfer.config import PlanMismatchError, RankResult, TransferConfig, TransferError
from sync_runtime.transfer.group import SyncGroup
from sync_runtime.transfer.staging import DestinationWeights
from sync_runtime.transfer.verify import send_source, verify_plan_against_tensors
from sync_runtime.transfer.waiter import Message, RoundWaiter

ProgressFn = Callable[[int, int], None]
_TAG_ROUND_SHIFT = 12  # up to 4096 buckets per (pair, round); rounds wrap at 2^19, far beyond any plan


@dataclass(slots=True)
class _InFlight:
    """One posted round: its receive buffers (to unpack) and the waiter on its messages."""

    index: int
    recv_bufs: list[torch.Tensor]
    send_bufs: list[torch.Tensor]
    waiter: RoundWaiter | None


@dataclass(slots=True)
class _Executor:
    group: SyncGroup
    plan: RankPlan
    sources: Mapping[str, torch.Tensor] | None
    destination: DestinationWeights | None
    config: TransferConfig
    sync_id: int
    on_progress: ProgressFn | None
    device: torch.device = field(init=False)
    where: str = "before round 0"
    """What the rank was doing, for errors that do not say it themselves."""
    send_bytes: int = 0
    recv_bytes: int = 0
    total_bytes: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.config.device)
        self.total_bytes = sum(b.nbytes for r in (*self.plan.sends, *self.plan.recvs) for b in r)

    def run(self) -> None:
        n = len(self.plan.sends)
        if n == 0:
            return
        current = self._post(0, self._pack(0))
        for i in range(n):
            nxt = i + 1 if i + 1 < n else None
            early = nxt is not None and not self._reads_staging(nxt)
            packed = self._pack(nxt) if early and nxt is not None else None
            self._wait(current)
            following = self._post(nxt, packed) if packed is not None and nxt is not None else None
            self._unpack(current)
            if nxt is not None and following is None:
                following = self._post(nxt, self._pack(nxt))
            if following is None:
                return
            current = following

    def _reads_staging(self, round_index: int) -> bool:
        """True when a send of that round forwards bytes this rank receives (relay)."""
        return any(
            self.sources is None or t.src_name not in self.sources
            for b in self.plan.sends[round_index]
            for t in b.transfers
        )

    def _source(self, name: str) -> torch.Tensor:
        if self.sources is not None and name in self.sources:
            return self.sources[name]
        if self.destination is not None:
            return self.destination.staged(name)  # relay: forward the new version, not the live one
        tensor = send_source(name, self.sources, self.destination)
        if tensor is None:
            raise PlanMismatchError(f"rank {self.plan.rank}: no source tensor {name!r}")
        return tensor

    def _pack(self, round_index: int) -> list[torch.Tensor]:
        self.where = f"round {round_index} (packing)"
        bufs = []
        for bucket in self.plan.sends[round_index]:
            buf = pack_bucket(bucket, self._source, self.device)
            if testing.HOOKS.after_pack is not None:
                testing.HOOKS.after_pack(round_index, bucket, buf)
            bufs.append(buf)
        return bufs

    def _post(self, round_index: int, send_bufs: list[torch.Tensor]) -> _InFlight:
        if testing.HOOKS.before_round is not None:
            testing.HOOKS.before_round(round_index)
        self.where = f"round {round_index} (posting)"
        recv_buckets = self.plan.recvs[round_index]
        send_buckets = self.plan.sends[round_index]
        recv_bufs = [empty_message(b, self.device) for b in recv_buckets]
        recvs = [
            (b.src_rank, buf, tag)
            for b, buf, tag in zip(
                recv_buckets, recv_bufs, _tags(recv_buckets, round_index, "src"), strict=True
            )
        ]
        sends = [
            (b.dst_rank, buf, tag)
            for b, buf, tag in zip(
                send_buckets, send_bufs, _tags(send_buckets, round_index, "dst"), strict=True
            )
        ]
        if not recvs and not sends:
            return _InFlight(round_index, recv_bufs, send_bufs, None)
        messages = [Message("recv from", b.src_rank, b.nbytes) for b in recv_buckets]
        messages += [Message("send to", b.dst_rank, b.nbytes) for b in send_buckets]
        works = self.group.post(sends, recvs)
        waiter = RoundWaiter(works, messages, time.monotonic() + self.config.timeout_s)
        return _InFlight(round_index, recv_bufs, send_bufs, waiter)

    def _wait(self, flight: _InFlight) -> None:
        if flight.waiter is None:
            return
        try:
            flight.waiter.wait(
                rank=self.plan.rank,
                round_index=flight.index,
                timeout_s=self.config.timeout_s,
                poll_s=self.config.poll_interval_s,
                peer_failure=lambda: self.group.peer_failure(self.sync_id),
            )
        except TransferError:
            self.group.adopt(flight.waiter.thread)
            raise
        self.send_bytes += sum(b.nbytes for b in self.plan.sends[flight.index])
        self.recv_bytes += sum(b.nbytes for b in self.plan.recvs[flight.index])
        flight.send_bufs.clear()  # free round i's send buffers before round i+1's receives land
        if self.on_progress is not None:
            self.on_progress(self.send_bytes + self.recv_bytes, self.total_bytes)

    def _unpack(self, flight: _InFlight) -> None:
        self.where = f"round {flight.index} (unpacking)"
        assert self.destination is not None or not flight.recv_bufs
        for bucket, buf in zip(self.plan.recvs[flight.index], flight.recv_bufs, strict=True):
            bad = unpack_bucket(bucket, buf, self.destination.staged)  # type: ignore[union-attr]
            if bad:
                t = bad[0]
                raise TransferError(
                    f"checksum mismatch: rank {self.plan.rank} tensor {t.tensor} from rank {bucket.src_rank} "
                    f"round {flight.index} (step verify; staged {t.dst_name}{list(t.dst_box)}; "
                    f"{len(bad)} bad transfer(s) in the bucket)",
                    step="verify",
                )
        flight.recv_bufs.clear()


def _tags(buckets: tuple[Bucket, ...], round_index: int, peer_attr: str) -> list[int]:
    """Message tags: the round, and the bucket's index among this round's buckets with the same peer."""
    seen: dict[int, int] = {}
    tags = []
    for b in buckets:
        peer = getattr(b, f"{peer_attr}_rank")
        k = seen.get(peer, 0)
        seen[peer] = k + 1
        tags.append(((round_index << _TAG_ROUND_SHIFT) | k) & 0x7FFFFFFF)
    return tags


def run_rank_plan(
    group: SyncGroup,
    plan: RankPlan,
    *,
    sources: Mapping[str, torch.Tensor] | None,
    destination: DestinationWeights | None,
    config: TransferConfig,
    on_progress: ProgressFn | None = None,
) -> RankResult:
    """Run this rank's sends and receives of one sync. Never raises for a transfer failure.

    Collective: every rank of the group calls it once per sync with its RankPlan of the same
    plan; it returns ok=True only when every rank finished without error. Destination ranks must
    have called `destination.begin(version)`; the caller commits or aborts afterwards.
    """
    start = time.perf_counter()
    sync_id = group.begin_sync()
    ex = _Executor(group, plan, sources, destination, config, sync_id, on_progress)
    try:
        if not group.healthy:
            raise TransferError(
                f"rank {plan.rank}: group {group.name} saw a failure; close() and reconnect", step="connect"
            )
        verify_plan_against_tensors(plan, sources, destination)
        if any(plan.recvs) and (destination is None or not destination.staging_active):
            raise TransferError(
                f"rank {plan.rank}: destination.begin(version) was not called (step transfer)"
            )
        group.agree_digest(sync_id, plan.digest)
        ex.run()
        group.finish(sync_id, config.timeout_s, last_round=len(plan.sends) - 1)
    except Exception as e:
        step = "plan" if isinstance(e, PlanMismatchError) else getattr(e, "step", "transfer")
        if isinstance(e, TransferError):
            message = str(e)
        else:  # PlanMismatchError names rank, tensor and box; add where it happened, like the rest
            kind = "" if isinstance(e, PlanMismatchError) else f"unexpected {type(e).__name__}: "
            message = f"rank {plan.rank}: {ex.where}, no peer (step {step}): {kind}{e}"

        group.report_failure(sync_id, message)
        return RankResult(
            plan.rank, False, ex.send_bytes, ex.recv_bytes, time.perf_counter() - start, message, step
        )
    return RankResult(plan.rank, True, ex.send_bytes, ex.recv_bytes, time.perf_counter() - start)
