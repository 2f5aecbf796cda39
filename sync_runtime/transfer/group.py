"""The sync's process group: one per WeightSync lifetime per participant, reused across syncs.

Why a standalone backend object (`ProcessGroupGloo` / `ProcessGroupNCCL` built directly on a
store) and not `init_process_group` / `new_group`: the participant is a Megatron trainer or a
vLLM worker that usually already owns the default group, `new_group` would have to be called
collectively by *their* world, and a second `init_process_group` is refused. A backend object
needs only a store, a rank and a size, and lives and dies with this class. Every key it writes
sits under `weightsync/<group_name>/<generation>/`, so several WeightSyncs (and successive
reconnects of one) share the coordinator's TCPStore without colliding.

The store also carries the sync's control plane (design §2.6): the plan digest every rank must
agree on, the first failure of a sync (`failed`, a SyncFailure as JSON, so a peer reads back who
failed and why as fields), and the end-of-sync decision (`end`).
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from sync_runtime.errors import (
    ConnectError,
    PeerFailed,
    PlanMismatchError,
    SyncFailure,
    SyncStep,
    TransferTimeout,
    describe_unexpected,
)
from sync_runtime.transfer.buffers import BufferPool

_END_OK = "ok"
_END_FAILED = "failed"


def _short(digest: str) -> str:
    plan, sep, settings = digest.partition("|")
    return plan[:16] + sep + settings


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class SyncGroup:
    """A process group over all source and destination ranks of one WeightSync."""

    def __init__(
        self,
        *,
        store: dist.Store,
        backend: dist.Backend,
        rank: int,
        world_size: int,
        kind: str,
        timeout_s: float,
        name: str,
    ) -> None:
        self.store = store
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.kind = kind
        self.timeout_s = timeout_s
        self.name = name
        self.healthy = True
        """False after any failed sync: close() and reconnect; a group that saw a failure is not reused."""
        self._syncs = 0
        self.buffers = BufferPool()
        """Message buffers reused across syncs (the warm path repeats the plan's bucket sizes)."""
        self._orphans: list[threading.Thread] = []
        self._closed = False

    @classmethod
    def connect(
        cls,
        *,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        group_name: str,
    ) -> SyncGroup:
        """Join group `group_name` through the coordinator's TCPStore (collective over world_size ranks).

        Every participant of one group must call this once per connection generation; the
        generation comes from a counter in the store so a reconnect after a failure never reads
        the previous connection's rendezvous keys.
        """
        where = f"rank {rank} of {world_size}: connect to group {group_name!r} via {store_host}:{store_port}"
        if backend not in ("gloo", "nccl"):
            raise ConnectError(f"{where}: backend={backend!r}, must be 'gloo' or 'nccl'", rank=rank)
        timeout = timedelta(seconds=timeout_s)
        try:
            client = dist.TCPStore(
                store_host, store_port, is_master=False, timeout=timeout, wait_for_workers=False
            )
            root = _root(client, group_name)
            generation = (root.add(_connect_key(world_size), 1) - 1) // world_size
            store = dist.PrefixStore(str(generation), root)
            pg = _make_backend(dist.PrefixStore("pg", store), rank, world_size, backend, timeout)
        except Exception as e:  # the store and backend raise several unrelated types
            raise ConnectError(f"{where} failed: {describe_unexpected(e)}", rank=rank) from e
        name = f"{group_name}/{generation}"
        return cls(
            store=store,
            backend=pg,
            rank=rank,
            world_size=world_size,
            kind=backend,
            timeout_s=timeout_s,
            name=name,
        )

    # -- messages ---------------------------------------------------------------------------

    def post(
        self, sends: list[tuple[int, torch.Tensor, int]], recvs: list[tuple[int, torch.Tensor, int]]
    ) -> list[dist.Work]:
        """Start one round's messages, `(peer, buffer, tag)` each; returns Works in recvs+sends order.

        gloo: every irecv is posted before any isend, so two ranks that send to each other in the
        same round cannot block on each other. NCCL: the whole round is one coalesced group
        (batch_isend_irecv semantics, ncclGroupStart/End), the only deadlock-free way to issue
        crossing sends there; it yields one Work for the round.
        """
        if self.kind == "nccl":
            self.backend._start_coalescing()
            for peer, buf, tag in recvs:
                self.backend.recv([buf], peer, tag)
            for peer, buf, tag in sends:
                self.backend.send([buf], peer, tag)
            return [self.backend._end_coalescing()]
        works = []
        ops = ((self.backend.recv, "recv from", recvs), (self.backend.send, "send to", sends))
        for op, what, messages in ops:
            for peer, buf, tag in messages:
                try:
                    works.append(op([buf], peer, tag))
                except RuntimeError as e:
                    # gloo refuses the op at once when the pair's connection is already closed:
                    # the peer's process died (the error names an address, not a rank)
                    raise ConnectError(
                        f"rank {self.rank}: posting a {what} rank {peer} failed: {e}",
                        rank=self.rank,
                        peer=peer,
                        step=SyncStep.TRANSFER,
                    ) from e
        return works

    def adopt(self, thread: threading.Thread) -> None:
        """Keep a waiter thread (and the Works and buffers it holds) alive until close().

        A timed-out gloo operation may still be registered with its pair; its buffer must
        outlive it, and the backend must not be destroyed under a thread blocked in wait().
        """
        self._orphans.append(thread)

    # -- control plane through the store ----------------------------------------------------

    def begin_sync(self) -> int:
        """Number of this sync on this group; every rank calls run_rank_plan once per sync."""
        self._syncs += 1
        return self._syncs

    def agree_digest(self, sync_id: int, digest: str) -> None:
        """Every rank must run the same plan with the same message format (`digest|format`)."""
        agreed = _text(self.store.compare_set(f"sync/{sync_id}/digest", "", digest))
        if agreed != digest:
            raise PlanMismatchError(
                f"rank {self.rank}: plan digest {_short(digest)} differs from the group's {_short(agreed)} "
                f"(sync {sync_id}): participants were given different plans or settings",
                rank=self.rank,
            )

    def report_failure(self, sync_id: int, failure: SyncFailure) -> None:
        """Publish this rank's failure (first writer wins) and end the sync as failed. Best effort."""
        self.healthy = False
        # The store may be the thing that failed; peers then hit their timeouts.
        with contextlib.suppress(Exception):
            _publish(self.store, sync_id, failure)

    def peer_failure(self, sync_id: int) -> SyncFailure | None:
        """The first failure published for this sync (by a rank or the coordinator), if any."""
        key = f"sync/{sync_id}/failed"
        if not self.store.check([key]):
            return None
        return SyncFailure.model_validate_json(_text(self.store.get(key)))

    def finish(self, sync_id: int, timeout_s: float, last_round: int) -> None:
        """Collective end of a sync: returns only when every rank finished its part without error.

        The last rank to finish writes `end=ok`; a failing rank writes `end=failed`. Ranks wait
        on that one key (a blocking store wait, no polling).
        """
        prefix = f"sync/{sync_id}"
        self.store.set(f"{prefix}/ok/{self.rank}", "1")
        if self.store.add(f"{prefix}/done", 1) == self.world_size:
            self.store.compare_set(f"{prefix}/end", "", _END_OK)
        try:
            self.store.wait([f"{prefix}/end"], timedelta(seconds=timeout_s))
        except Exception as e:
            missing = [r for r in range(self.world_size) if not self.store.check([f"{prefix}/ok/{r}"])]
            raise TransferTimeout(
                f"rank {self.rank}: end of sync {sync_id} after round {last_round}: "
                f"timed out after {timeout_s:.1f}s waiting for ranks {missing} to finish",
                rank=self.rank,
                peer=missing[0] if len(missing) == 1 else None,
            ) from e
        if _text(self.store.get(f"{prefix}/end")) != _END_OK:
            raise peer_failed(
                self.rank, f"end of sync {sync_id} after round {last_round}", self.peer_failure(sync_id)
            )

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the backend; never blocks.

        Waiter threads of a failed sync may still sit in `Work.wait` until their deadline (gloo
        cannot interrupt them); the backend must outlive them, so a reaper thread holds it and
        shuts it down once they are done.
        """
        if self._closed:
            return
        self._closed = True
        self.healthy = False
        self.buffers.clear()
        orphans, self._orphans = [t for t in self._orphans if t.is_alive()], []
        if not orphans:
            _shutdown(self.backend, self.kind)
            return
        reaper = threading.Thread(
            target=_reap, args=(self.backend, self.kind, orphans), name="weightsync-reaper", daemon=True
        )
        reaper.start()


def peer_failed(rank: int, where: str, failure: SyncFailure | None) -> PeerFailed:
    """This rank's error for a sync another rank (or the coordinator) failed first."""
    if failure is None:
        return PeerFailed(
            f"rank {rank}: {where}: the sync ended as failed", rank=rank, step=SyncStep.TRANSFER
        )
    who = f"peer rank {failure.rank}" if failure.rank is not None else "the coordinator"
    return PeerFailed(
        f"rank {rank}: {where}: {who} failed ({failure.reason}): {failure.message}",
        rank=rank,
        peer=failure.rank,
        step=SyncStep.TRANSFER,
    )


def publish_failure(
    store: dist.Store, *, group_name: str, world_size: int, sync_id: int, failure: SyncFailure
) -> bool:
    """Publish `failure` (of rank `failure.rank`) for sync `sync_id` on the latest connection of
    group `group_name`.

    For whoever hosts the store (the coordinator) when a rank cannot publish its own failure
    (it died or hangs): every rank of the sync then aborts within one poll interval instead of
    at its timeout, with `failure` as the named cause. Same effect as the rank's own report:
    the first failure of a sync wins, and the sync ends as failed. `world_size` and `sync_id`
    are those the ranks use (SyncGroup.connect, the n-th run_rank_plan on the group, from 1).
    Returns False when no rank ever joined the group (nothing to tell). Raises what the store
    raises.
    """
    root = _root(store, group_name)
    joined = root.add(_connect_key(world_size), 0)
    if joined == 0:
        return False
    generation = (joined - 1) // world_size  # the connection the ranks joined last
    _publish(dist.PrefixStore(str(generation), root), sync_id, failure)
    return True


def _root(store: dist.Store, group_name: str) -> dist.Store:
    return dist.PrefixStore(f"weightsync/{group_name}", store)


def _connect_key(world_size: int) -> str:
    return f"connect/{world_size}"


def _publish(store: dist.Store, sync_id: int, failure: SyncFailure) -> None:
    store.compare_set(f"sync/{sync_id}/failed", "", failure.model_dump_json(by_alias=True))
    store.compare_set(f"sync/{sync_id}/end", "", _END_FAILED)


def _reap(backend: dist.Backend, kind: str, orphans: list[threading.Thread]) -> None:
    for thread in orphans:
        thread.join()  # each has a deadline: at most timeout_s after its round was posted
    _shutdown(backend, kind)


def _shutdown(backend: dist.Backend, kind: str) -> None:
    try:
        if kind == "nccl":
            backend.abort()  # frees communicators even if a kernel is stuck on a dead peer
        else:
            backend.shutdown()
    except Exception:
        pass  # closing a broken group must not raise


def _make_backend(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout: timedelta
) -> dist.Backend:
    if backend == "gloo":
        # Builds the full mesh of pair connections now (blocking up to `timeout`), so a peer that
        # never joins is reported at connect, not in the middle of the first sync.
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    # Eager communicator creation on the caller's current device: connect errors surface here.
    pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return pg
