"""Execute one rank's part of a plan: pack, send, receive, unpack, verify; double-buffered.

Rounds run in order; round i+1 is posted only after every message of round i completed (the
planner sized rounds to the receivers' fan-in and staging budget). Inside that order the work
overlaps at bucket granularity:
- every receive of round i is posted first (gloo: no send can then block on a missing receive);
- each send bucket is posted as soon as it is packed, so packing bucket k+1 overlaps sending k;
- while round i is on the wire, round i+1's send buckets are packed, and round i's received
  buckets are unpacked and verified as each one lands.
At most two rounds of buffers are alive: round i's (in flight) and round i+1's packed sends,
the staging budget the planner assumes. A relay rank forwards bytes it receives, so it packs
round i+1 only after round i was unpacked. NCCL issues a round as one coalesced group instead
(see SyncGroup.post), so there a round's sends are all packed before it is posted.
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
from sync_runtime.transfer.verify import verify_plan_against_tensors
from sync_runtime.transfer.waiter import Completion, Key, Message, MessageWaiter

ProgressFn = Callable[[int, int], None]
_TAG_ROUND_SHIFT = 12  # up to 4096 buckets per (pair, round); rounds wrap at 2^19, far beyond any plan


@dataclass(slots=True)
class _Round:
    """One posted round: buffers still needed and messages not yet completed."""

    index: int
    recv_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    send_bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    outstanding: set[Key] = field(default_factory=set)


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
    waiter: MessageWaiter | None = None
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
        if not any(self.plan.sends) and not any(self.plan.recvs):
            return
        self.waiter = MessageWaiter(self.device)
        ahead: dict[int, torch.Tensor] | None = None
        for i in range(n):
            flight = self._start_round(i, ahead)
            ahead = None
            if i + 1 < n and not self._reads_staging(i + 1):
                ahead = self._pack_round(i + 1, flight)
            self._drain(flight, block=True)
        self.waiter.stop()

    def _reads_staging(self, round_index: int) -> bool:
        """True when a send of that round forwards bytes this rank receives (relay)."""
        srcs = self.sources or {}
        return any(t.src_name not in srcs for b in self.plan.sends[round_index] for t in b.transfers)

    def _source(self, name: str) -> torch.Tensor:
        if self.sources is not None and name in self.sources:
            return self.sources[name]
        if self.destination is None:
            raise PlanMismatchError(f"rank {self.plan.rank}: no source tensor {name!r}")
        return self.destination.staged(name)  # relay: forward the new version, not the live one

    def _pack(self, round_index: int, j: int, bucket: Bucket) -> torch.Tensor:
        self.where = f"round {round_index} (packing bucket {j} for rank {bucket.dst_rank})"
        buf = pack_bucket(bucket, self._source, self.device, self.group.buffers)
        if testing.HOOKS.after_pack is not None:
            testing.HOOKS.after_pack(round_index, bucket, buf)
        return buf

    def _pack_round(self, round_index: int, inflight: _Round | None) -> dict[int, torch.Tensor]:
        """Pack a round's sends ahead; between buckets, unpack what already landed of `inflight`."""
        out = {}
        for j, bucket in enumerate(self.plan.sends[round_index]):
            out[j] = self._pack(round_index, j, bucket)
            if inflight is not None:
                self._drain(inflight, block=False)
        return out

    def _start_round(self, i: int, packed: dict[int, torch.Tensor] | None) -> _Round:
        if testing.HOOKS.before_round is not None:
            testing.HOOKS.before_round(i)
        self.where = f"round {i} (posting)"
        flight = _Round(i)
        recv_buckets, send_buckets = self.plan.recvs[i], self.plan.sends[i]
        flight.recv_bufs = {
            j: empty_message(b, self.device, self.group.buffers) for j, b in enumerate(recv_buckets)
        }
        rtags, stags = _tags(recv_buckets, i, "src"), _tags(send_buckets, i, "dst")
        recvs = [(b.src_rank, flight.recv_bufs[j], rtags[j]) for j, b in enumerate(recv_buckets)]
        if self.group.kind == "nccl":  # one coalesced group: every send must be packed first
            flight.send_bufs = packed if packed is not None else self._pack_round(i, None)
            sends = [(b.dst_rank, flight.send_bufs[j], stags[j]) for j, b in enumerate(send_buckets)]
            peers = sorted({b.src_rank for b in recv_buckets} | {b.dst_rank for b in send_buckets})
            if sends or recvs:
                (work,) = self.group.post(sends, recvs)
                self._track(flight, work, ("round", 0), f"exchange with ranks {peers}")
            return flight
        for j, work in enumerate(self.group.post([], recvs)):
            b = recv_buckets[j]
            self._track(flight, work, ("recv", j), f"recv from rank {b.src_rank} ({b.nbytes} bytes)")
        for j, b in enumerate(send_buckets):
            buf = packed[j] if packed is not None else self._pack(i, j, b)
            flight.send_bufs[j] = buf
            (work,) = self.group.post([(b.dst_rank, buf, stags[j])], [])
            self._track(flight, work, ("send", j), f"send to rank {b.dst_rank} ({b.nbytes} bytes)")
        return flight

    def _track(self, flight: _Round, work: torch.distributed.Work, key: Key, text: str) -> None:
        assert self.waiter is not None
        self.waiter.add(work, Message(flight.index, key, text, time.monotonic() + self.config.timeout_s))
        flight.outstanding.add(key)

    def _drain(self, flight: _Round, *, block: bool) -> None:
        """Handle completions of `flight`; with block=True until all its messages completed."""
        assert self.waiter is not None or not flight.outstanding
        while flight.outstanding:
            done = self.waiter.next(self.config.poll_interval_s if block else 0.0)  # type: ignore[union-attr]
            if done is None:
                if not block:
                    return
                self._check_peers(flight.index)
                continue
            self._complete(flight, done)

    def _check_peers(self, round_index: int, cause: str | None = None) -> None:
        failure = self.group.peer_failure(self.sync_id)
        if failure is not None:
            who, why = failure
            raise TransferError(
                f"rank {self.plan.rank}: aborted in round {round_index} (step transfer): "
                f"peer rank {who} failed: {why}" + (f" [local transport error: {cause}]" if cause else "")
            )

    def _complete(self, flight: _Round, done: Completion) -> None:
        msg = done.message
        if done.error is not None:
            # A transport error is often the echo of a peer's failure (it closed its connections):
            # name the root cause when the peer published one.
            self._check_peers(flight.index, cause=done.error)
            reason = (
                f"timed out after {self.config.timeout_s:.1f}s"
                if "timed out" in done.error.lower()
                else done.error
            )
            where = f"rank {self.plan.rank}: round {flight.index}: {msg.description}"
            raise TransferError(f"{where} failed (step transfer): {reason}")
        flight.outstanding.discard(msg.key)
        kind, j = msg.key
        if kind in ("recv", "round"):
            for k in [j] if kind == "recv" else list(flight.recv_bufs):
                self._unpack(flight, k)
        if kind in ("send", "round"):
            for k in [j] if kind == "send" else list(flight.send_bufs):
                self.send_bytes += self.plan.sends[flight.index][k].nbytes
                self.group.buffers.put(flight.send_bufs.pop(k))  # reusable as soon as the wire is done
        if self.on_progress is not None:
            self.on_progress(self.send_bytes + self.recv_bytes, self.total_bytes)

    def _unpack(self, flight: _Round, j: int) -> None:
        bucket = self.plan.recvs[flight.index][j]
        self.where = f"round {flight.index} (unpacking bucket from rank {bucket.src_rank})"
        assert self.destination is not None
        buf = flight.recv_bufs.pop(j)
        bad = unpack_bucket(bucket, buf, self.destination.staged)
        self.group.buffers.put(buf)
        if bad:
            t = bad[0]
            raise TransferError(
                f"checksum mismatch: rank {self.plan.rank} tensor {t.tensor} from rank {bucket.src_rank} "
                f"round {flight.index} (step verify; staged {t.dst_name}{list(t.dst_box)}; "
                f"{len(bad)} bad transfer(s) in the bucket)",
                step="verify",
            )
        self.recv_bytes += bucket.nbytes


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

    Collective: every rank of the group calls it once per sync (even with nothing to move) with
    its RankPlan of the same plan; it returns ok=True only when every rank finished without
    error. Destination ranks must have called `destination.begin(version)`; the caller commits
    (all ok) or aborts afterwards. A relay rank's sends read its destination staging.
    """
    start = time.perf_counter()
    sync_id = group.begin_sync()
    ex = _Executor(group, plan, sources, destination, config, sync_id, on_progress)
    try:
        _preflight(group, plan, sources, destination, config)
        group.agree_digest(sync_id, plan.digest)
        ex.run()
        group.finish(sync_id, config.timeout_s, last_round=len(plan.sends) - 1)
    except Exception as e:
        message, step = _describe_failure(e, plan.rank, ex.where, _peer_failure(group, sync_id))
        group.report_failure(sync_id, message)
        if ex.waiter is not None:  # a Work may still be in flight; the group keeps it until close()
            ex.waiter.abandon()
            group.adopt(ex.waiter.thread)
        return RankResult(
            plan.rank, False, ex.send_bytes, ex.recv_bytes, time.perf_counter() - start, message, step
        )
    return RankResult(plan.rank, True, ex.send_bytes, ex.recv_bytes, time.perf_counter() - start)


def _preflight(
    group: SyncGroup,
    plan: RankPlan,
    sources: Mapping[str, torch.Tensor] | None,
    destination: DestinationWeights | None,
    config: TransferConfig,
) -> None:
    if config.backend != group.kind:
        raise TransferError(
            f"rank {plan.rank}: config.backend={config.backend}, group {group.name} is {group.kind}",
            step="connect",
        )
    if not group.healthy:
        raise TransferError(
            f"rank {plan.rank}: group {group.name} saw a failure; close() and reconnect", step="connect"
        )
    verify_plan_against_tensors(plan, sources, destination)
    if any(plan.recvs) and (destination is None or not destination.staging_active):
        raise TransferError(f"rank {plan.rank}: destination.begin(version) was not called (step transfer)")


def _peer_failure(group: SyncGroup, sync_id: int) -> tuple[int, str] | None:
    try:
        return group.peer_failure(sync_id)
    except Exception:
        return None  # the store itself is gone; describe the local error


def _describe_failure(e: Exception, rank: int, where: str, peer: tuple[int, str] | None) -> tuple[str, str]:
    step = "plan" if isinstance(e, PlanMismatchError) else getattr(e, "step", "transfer")
    if isinstance(e, TransferError):
        return str(e), step
    if peer is not None and not isinstance(e, PlanMismatchError):
        # e.g. posting to a peer that already failed and closed its connections: name the cause.
        who, why = peer
        return (
            f"rank {rank}: aborted in {where} (step transfer): peer rank {who} failed: {why} [local: {e}]",
            step,
        )
    # PlanMismatchError names rank, tensor and box; add where it happened, like the rest.
    kind = "" if isinstance(e, PlanMismatchError) else f"unexpected {type(e).__name__}: "
    return f"rank {rank}: {where}, no peer (step {step}): {kind}{e}", step
