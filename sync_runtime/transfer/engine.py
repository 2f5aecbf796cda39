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

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from sync_runtime.core.layouts.base import Box
from sync_runtime.core.plan import Bucket, RankPlan
from sync_runtime.errors import (
    ChecksumMismatch,
    ConnectError,
    DestinationError,
    PlanMismatchError,
    SourceError,
    SyncFailure,
    SyncStep,
    TransferTimeout,
    WeightSyncError,
    describe_unexpected,
)
from sync_runtime.transfer.buffers import Incoming, Outgoing, bad_transfers, land, pack_bucket, receive_bucket
from sync_runtime.transfer.config import RankResult, TransferConfig
from sync_runtime.transfer.delta_wire import DeltaIO, KeptBits, account, agreed, delta_io
from sync_runtime.transfer.dtypes import WireDtypes
from sync_runtime.transfer.fence import check_fence, fingerprint
from sync_runtime.transfer.group import SyncGroup, peer_failed
from sync_runtime.transfer.spans import span
from sync_runtime.transfer.staging import Staging, tiles_exactly
from sync_runtime.transfer.tags import Tags
from sync_runtime.transfer.verify import preflight
from sync_runtime.transfer.waiter import Completion, Key, Message, MessageWaiter

log = logging.getLogger("weightsync.transfer")
ProgressFn = Callable[[int, int], None]
Emit = Callable[[torch.Tensor], None]
"""Called with each direct message of a bucket as soon as it is packed (buffers.pack_bucket)."""
_MsgRef = tuple[int, int]
"""(bucket index in the round, message index in the bucket)."""


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """An optional observer of one rank's run, called at two fixed points of the engine.

    For tests only: they inject faults exactly where real ones would happen (a byte corrupted
    after the checksum was taken, a crash or a stall between rounds). Production never passes
    one (`run_rank_plan(hooks=None)`), so the hot path pays one `is None` check per bucket.
    """

    after_pack: Callable[[int, Bucket, torch.Tensor], None] | None = None
    """(round, bucket, tail message) after a bucket was packed and checksummed. The tail holds the
    small transfers' bytes, then the header of every transfer's checksum: flipping any of its
    bytes must fail the receiver's verification."""
    before_round: Callable[[int], None] | None = None
    """(round) before a round's messages are posted."""


@dataclass(slots=True)
class _Round:
    """One posted round: buckets still in flight and messages not yet completed."""

    index: int
    incoming: dict[int, Incoming] = field(default_factory=dict)
    outgoing: dict[int, Outgoing] = field(default_factory=dict)
    recv_refs: list[_MsgRef] = field(default_factory=list)
    send_refs: list[_MsgRef] = field(default_factory=list)
    sends_left: dict[int, int] = field(default_factory=dict)
    outstanding: set[Key] = field(default_factory=set)


@dataclass(slots=True)
class _Executor:
    group: SyncGroup
    plan: RankPlan
    sources: Mapping[str, torch.Tensor] | None
    destination: Staging | None
    config: TransferConfig
    sync_id: int
    on_progress: ProgressFn | None
    hooks: EngineHooks | None
    delta: DeltaIO | None
    device: torch.device = field(init=False)
    wire: WireDtypes = field(init=False)  # per transfer, the dtype its bytes travel in (dtypes.py)
    waiter: MessageWaiter | None = None
    where: str = "before round 0"
    """What the rank was doing, for errors that do not say it themselves."""
    send_bytes: int = 0
    recv_bytes: int = 0
    total_bytes: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.config.device)
        self.wire = WireDtypes(self.config.wire_dtypes, self.sources, self.destination)
        self.total_bytes = sum(b.nbytes for r in (*self.plan.sends, *self.plan.recvs) for b in r)

    def run(self) -> None:
        n = len(self.plan.sends)
        if not any(self.plan.sends) and not any(self.plan.recvs):
            return
        self._allocate_staging()
        self.waiter = MessageWaiter(self.device)
        ahead: dict[int, Outgoing] | None = None
        for i in range(n):
            flight = self._start_round(i, ahead)
            ahead = None
            if i + 1 < n and not self._reads_staging(i + 1):
                ahead = self._pack_round(i + 1, flight)
            self._drain(flight, block=True)
        self.waiter.stop()

    @span("transfer.allocate_staging")
    def _allocate_staging(self) -> None:
        """Allocate every staged tensor up front; zero only those the plan does not tile exactly.

        Zeroing is a full pass over the destination's memory, and the plan writes every element
        of almost every tensor (only padding, e.g. vocab rows past V, is left out).
        """
        boxes: dict[str, list[Box]] = {}
        for t in (t for r in self.plan.recvs for b in r for t in b.transfers):
            boxes.setdefault(t.dst_name, []).append(t.dst_box)
        assert self.destination is not None or not boxes
        for name, name_boxes in boxes.items():
            shape = tuple(self.destination.tensors[name].shape)  # type: ignore[union-attr]
            self.destination.staged(name, fully_written=tiles_exactly(name_boxes, shape))  # type: ignore[union-attr]

    def _reads_staging(self, round_index: int) -> bool:
        """True when a send of that round forwards bytes this rank receives (relay)."""
        srcs = self.sources or {}
        return any(t.src_name not in srcs for b in self.plan.sends[round_index] for t in b.transfers)

    def _source(self, name: str) -> torch.Tensor:
        if self.sources is not None and name in self.sources:
            return self.sources[name]
        if self.destination is None:
            raise PlanMismatchError(f"rank {self.plan.rank}: no source tensor {name!r}", tensor=name)
        return self.destination.staged(name)  # relay: forward the new version, not the live one

    def _staged(self, name: str) -> torch.Tensor:
        assert self.destination is not None
        return self.destination.staged(name)

    @span("transfer.pack_and_checksum")
    def _pack(self, round_index: int, j: int, bucket: Bucket, emit: Emit | None = None) -> Outgoing:
        self.where = f"round {round_index} (packing bucket {j} for rank {bucket.dst_rank})"
        cfg, pool = self.config, self.group.buffers
        out = pack_bucket(
            bucket, self._source, self.device, pool, cfg.direct_min_bytes, self.wire.send, self.delta, emit
        )
        if self.hooks is not None and self.hooks.after_pack is not None:
            self.hooks.after_pack(round_index, bucket, out.tail)
        return out

    def _pack_round(self, round_index: int, inflight: _Round | None) -> dict[int, Outgoing]:
        """Pack a round's sends ahead; between buckets, unpack what already landed of `inflight`."""
        out = {}
        for j, bucket in enumerate(self.plan.sends[round_index]):
            out[j] = self._pack(round_index, j, bucket)
            if inflight is not None:
                self._drain(inflight, block=False)
        return out

    def _start_round(self, i: int, packed: dict[int, Outgoing] | None) -> _Round:
        if self.hooks is not None and self.hooks.before_round is not None:
            self.hooks.before_round(i)
        self.where = f"round {i} (posting)"
        flight = _Round(i)
        recv_buckets, send_buckets = self.plan.recvs[i], self.plan.sends[i]
        rtags, stags = Tags(i), Tags(i)
        recvs, pool, direct = [], self.group.buffers, self.config.direct_min_bytes
        for j, b in enumerate(recv_buckets):
            inc = receive_bucket(b, self._staged, self.device, pool, direct, self.wire.recv, self.delta)
            flight.incoming[j] = inc
            for m, buf in enumerate(inc.messages):
                recvs.append((b.src_rank, buf, rtags.next(b.src_rank)))
                flight.recv_refs.append((j, m))
        if self.group.kind == "nccl":  # one coalesced group: every send must be packed first
            flight.outgoing = packed if packed is not None else self._pack_round(i, None)
            sends = self._send_list(flight, send_buckets, stags)
            peers = sorted({b.src_rank for b in recv_buckets} | {b.dst_rank for b in send_buckets})
            if sends or recvs:
                (work,) = self.group.post(sends, recvs)
                self._track(flight, work, ("round", 0), f"exchange with ranks {peers}")
            return flight
        for k, work in enumerate(self.group.post([], recvs)):
            b = recv_buckets[flight.recv_refs[k][0]]
            self._track(
                flight, work, ("recv", k), f"recv from rank {b.src_rank} ({b.nbytes} bytes)", b.src_rank
            )
        for j, b in enumerate(send_buckets):
            sent: list[torch.Tensor] = []  # bucket j's messages posted so far
            if packed is not None:
                out = flight.outgoing[j] = packed[j]
            else:  # each direct message goes out once built (the receiver lands it while the rest
                # is packed); the tail, which carries every checksum, goes last
                out = flight.outgoing[j] = self._pack(i, j, b, partial(self._post, flight, j, b, stags, sent))
            self._post(flight, j, b, stags, sent, *out.messages[len(sent) :])
        return flight

    def _post(self, flight: _Round, j: int, b: Bucket, tags: Tags, sent: list, *msgs: torch.Tensor) -> None:
        """Post the next messages of send bucket `j` (`sent`: those already posted, extended)."""
        first = len(flight.send_refs)
        sends = [(b.dst_rank, buf, tags.next(b.dst_rank)) for buf in msgs]
        flight.send_refs += [(j, len(sent) + m) for m in range(len(msgs))]
        sent.extend(msgs)
        flight.sends_left[j] = len(sent)  # the bucket's total once its tail is posted
        text = f"send to rank {b.dst_rank} ({b.nbytes} bytes)"
        for k, work in enumerate(self.group.post(sends, []), start=first):
            self._track(flight, work, ("send", k), text, b.dst_rank)

    def _send_list(
        self, flight: _Round, buckets: tuple[Bucket, ...], tags: Tags, first: int = 0
    ) -> list[tuple[int, torch.Tensor, int]]:
        """The messages of send buckets first..first+len(buckets)-1, registered in `flight`."""
        sends = []
        for j, b in enumerate(buckets, start=first):
            msgs = flight.outgoing[j].messages
            flight.sends_left[j] = len(msgs)
            for m, buf in enumerate(msgs):
                sends.append((b.dst_rank, buf, tags.next(b.dst_rank)))
                flight.send_refs.append((j, m))
        return sends

    def _track(
        self, flight: _Round, work: torch.distributed.Work, key: Key, text: str, peer: int | None = None
    ) -> None:
        assert self.waiter is not None
        deadline = time.monotonic() + self.config.timeout_s
        self.waiter.add(work, Message(flight.index, key, text, deadline, peer))
        flight.outstanding.add(key)

    def _drain(self, flight: _Round, *, block: bool) -> None:
        """Handle completions of `flight`; with block=True until all its messages completed."""
        assert self.waiter is not None or not flight.outstanding
        while flight.outstanding:
            with span("transfer.wire_wait" if block else "transfer.poll"):
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
            local = f" [local transport error: {cause}]" if cause else ""
            raise peer_failed(self.plan.rank, f"aborted in round {round_index}{local}", failure)

    def _complete(self, flight: _Round, done: Completion) -> None:
        msg = done.message
        if done.error is not None:
            # A transport error is often the echo of a peer's failure (it closed its connections):
            # name the root cause when the peer published one.
            self._check_peers(flight.index, cause=done.error)
            where = f"rank {self.plan.rank}: round {flight.index}: {msg.description}"
            if done.timed_out:
                raise TransferTimeout(
                    f"{where} timed out after {self.config.timeout_s:.1f}s",
                    rank=self.plan.rank,
                    peer=msg.peer,
                )
            # Not a timeout and no published failure: the connection itself broke (a peer died).
            raise ConnectError(
                f"{where} failed: {done.error}", rank=self.plan.rank, peer=msg.peer, step=SyncStep.TRANSFER
            )
        flight.outstanding.discard(msg.key)
        kind, k = msg.key
        if kind in ("recv", "round"):
            for j, m in [flight.recv_refs[k]] if kind == "recv" else flight.recv_refs:
                self._land(flight, j, m)
        if kind in ("send", "round"):
            for j, m in [flight.send_refs[k]] if kind == "send" else flight.send_refs:
                self._sent(flight, j, m)
        if self.on_progress is not None:
            self.on_progress(self.send_bytes + self.recv_bytes, self.total_bytes)

    def _sent(self, flight: _Round, j: int, m: int) -> None:
        out = flight.outgoing[j]
        if out.pooled[m]:
            self.group.buffers.put(out.messages[m])  # reusable as soon as the wire is done
        flight.sends_left[j] -= 1
        if flight.sends_left[j] == 0:
            self.send_bytes += self.plan.sends[flight.index][j].nbytes
            del flight.outgoing[j]

    @span("transfer.land_and_checksum")  # the copy out of a bounce buffer, the checksums
    def _land(self, flight: _Round, j: int, m: int) -> None:
        bucket = self.plan.recvs[flight.index][j]
        self.where = f"round {flight.index} (unpacking bucket from rank {bucket.src_rank})"
        inc = flight.incoming[j]
        land(inc, m, self._staged)
        if not inc.complete:
            return
        bad = bad_transfers(inc)
        del flight.incoming[j]
        for buf, pooled in zip(inc.messages, inc.pooled, strict=True):
            if pooled:
                self.group.buffers.put(buf)
        if bad:
            t = bad[0]
            raise ChecksumMismatch(
                f"checksum mismatch: rank {self.plan.rank} tensor {t.tensor} from rank {bucket.src_rank} "
                f"round {flight.index} (staged {t.dst_name}{list(t.dst_box)}; "
                f"{len(bad)} bad transfer(s) in the bucket)",
                rank=self.plan.rank,
                tensor=t.tensor,
                peer=bucket.src_rank,
            )
        self.recv_bytes += bucket.nbytes


def run_rank_plan(
    group: SyncGroup,
    plan: RankPlan,
    *,
    sources: Mapping[str, torch.Tensor] | None,
    destination: Staging | None,
    config: TransferConfig,
    on_progress: ProgressFn | None = None,
    hooks: EngineHooks | None = None,
    kept: KeptBits | None = None,
) -> RankResult:
    """Run this rank's sends and receives of one sync. Never raises for a transfer failure.

    Collective: every rank of the group calls it once per sync (even with nothing to move) with
    its RankPlan of the same plan; it returns ok=True only when every rank finished without
    error, else ok=False with the failure (reason, rank, step, peer, tensor). Destination ranks
    must have called `destination.begin(version)`; the caller commits (all ok) or aborts
    afterwards. A relay rank's sends read its destination staging. `hooks`: tests only.
    A source rank fences its tensors (fence.py): one that changed before the end fails the sync.
    `kept`: a source's copy of what it last sent, for `config.delta_base`'s transfers (delta_wire.py).
    """
    start = time.perf_counter()
    sync_id = group.begin_sync()
    delta = delta_io(config.delta_base, kept, destination)
    ex = _Executor(group, plan, sources, destination, config, sync_id, on_progress, hooks, delta)
    try:
        fence = fingerprint(sources) if sources is not None else None
        with span("transfer.preflight_agree"):
            preflight(group, plan, sources, destination, config)
            group.agree_digest(sync_id, agreed(plan.digest, config.direct_min_bytes, dict(config.delta_base)))
        with span("transfer.rounds"):
            ex.run()
        if fence is not None:  # before `finish`: every rank then fails with this as the cause
            check_fence(fence, sources, plan.rank)  # type: ignore[arg-type]
        with span("transfer.finish_agree"):
            group.finish(sync_id, config.timeout_s, last_round=len(plan.sends) - 1)
    except Exception as e:
        failure = _as_error(e, ex, _peer_failure(group, sync_id), is_source=sources is not None).to_failure()
        group.report_failure(sync_id, failure)
        if ex.waiter is not None:  # a Work may still be in flight; the group keeps it until close()
            ex.waiter.abandon()
            group.adopt(ex.waiter.thread)
        seconds = time.perf_counter() - start
        return RankResult(plan.rank, False, ex.send_bytes, ex.recv_bytes, seconds, failure=failure)
    seconds = time.perf_counter() - start
    return account(RankResult(plan.rank, True, ex.send_bytes, ex.recv_bytes, seconds), delta)


def _peer_failure(group: SyncGroup, sync_id: int) -> SyncFailure | None:
    try:
        return group.peer_failure(sync_id)
    except Exception:
        return None  # the store itself is gone; describe the local error


def _as_error(e: Exception, ex: _Executor, peer: SyncFailure | None, *, is_source: bool) -> WeightSyncError:
    """The typed error of a failed run. An exception the engine did not raise itself (the source's
    memory is gone, a transport call refused) is the rank's own failure unless a peer failed
    first; its traceback goes to the log, its one-line description into the failure."""
    rank = ex.plan.rank
    if isinstance(e, WeightSyncError) and not (isinstance(e, ConnectError) and peer is not None):
        return e.located(rank=rank)
    if peer is not None:  # a broken connection (ConnectError) is often the echo of a peer's failure
        # e.g. posting to a peer that already failed and closed its connections: name the cause.
        return peer_failed(rank, f"aborted in {ex.where} [local: {describe_unexpected(e)}]", peer)
    log.warning("rank %d: unexpected error in %s", rank, ex.where, exc_info=e)
    kind = SourceError if is_source else DestinationError  # a rank holding source tensors is a source
    return kind(f"rank {rank}: {ex.where}: {describe_unexpected(e)}", rank=rank)
