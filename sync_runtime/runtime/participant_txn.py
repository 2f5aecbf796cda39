"""A destination rank's side of the two-phase commit (transfer/txn.py has the record's keys).

prepare: after its transfer succeeded, the rank checksums what it staged and records
`prepared` (in the store, and in its own `LocalTxn`). commit: after the decision, it checks the
decision in the record (when the store is still reachable) and the staged checksum again (bytes
changed after the decision must never be applied), applies, and records `committed`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sync_runtime.errors import ChecksumMismatch, CommitFailed, SyncStep
from sync_runtime.transfer import CommitRecord, LocalTxn, Staging, commit_decision

log = logging.getLogger("weightsync.participant")
PROGRESS_INTERVAL_S = 0.1
"""Least time between two progress writes to the store (each is one round trip)."""


@dataclass(frozen=True, slots=True)
class TxnState:
    """What a destination rank tells a (possibly new) coordinator about its last transaction."""

    txn: str | None
    phase: str | None
    """staging | prepared | committed | aborted (None: no transaction yet)."""
    pending_version: str | None
    version: str
    """The committed version of the live weights."""
    serving: bool
    poisoned: bool
    checksum: str = ""


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the coordinator's store (the commit record and progress keys live there)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def prepare(dest: Staging, record: CommitRecord, local: LocalTxn, rank: int) -> None:
    """Record this rank's `prepared` (version, checksum of what it staged)."""
    local.checksum = dest.staged_checksum()
    record.prepare(rank, local.version, local.checksum)
    local.phase = "prepared"


def commit(
    dest: Staging, record: CommitRecord | None, local: LocalTxn | None, rank: int | None, version: str
) -> str:
    """Apply the staged `version` after the decision; raises (and aborts staging) when the
    decision in the record is not commit of `version`, or the staged bytes changed."""
    if local is None or local.version != version or local.phase != "prepared":
        have = f"{local.phase} {local.version!r}" if local else "no transaction"
        raise CommitFailed(f"rank {rank}: commit {version!r} but this rank holds {have}", rank=rank)
    decision = _read_decision(record)
    if decision is not None and decision != commit_decision(version):
        raise CommitFailed(
            f"rank {rank}: the record decided {decision!r}, not commit of {version!r}", rank=rank
        )
    now = dest.staged_checksum()
    if now != local.checksum:
        dest.abort()
        local.phase = "aborted"
        raise ChecksumMismatch(
            f"rank {rank}: staged bytes of {version!r} changed after the decision "
            f"(checksum {now} != prepared {local.checksum}); not applied",
            rank=rank,
            step=SyncStep.COMMIT,
        )
    committed = dest.commit(version)
    local.phase = "committed"
    if record is not None:
        # Best effort: the store may have died with its coordinator; the local record remains.
        with contextlib.suppress(Exception):
            record.mark_committed(rank if rank is not None else -1, committed)
    return committed


def _read_decision(record: CommitRecord | None) -> str | None:
    """The decision in the record; None when there is no record or the store is gone (the
    coordinator that calls commit then decided from the ranks' own records)."""
    if record is None:
        return None
    try:
        return record.decision()
    except Exception as e:  # the store host is gone: TCPStore raises several types
        log.warning("commit record unreachable, following the coordinator's decision: %s", e)
        return None


class ServingControl:
    """The serving switch and the transaction's account of a participant (part of its mixin)."""

    def _ws_state(self) -> Any:  # provided by WeightSyncParticipant
        raise NotImplementedError

    def ws_version(self) -> str | None:
        raise NotImplementedError

    def ws_checksums(self) -> dict[str, str]:
        raise NotImplementedError

    def ws_pause(self) -> bool:
        """Stop serving (before a commit applies a version). Returns the previous state."""
        st = self._ws_state()
        with st.lock:
            was, st.serving = st.serving, False
            return was

    def ws_resume(self, version: str) -> bool:
        """Serve again, only when this rank holds exactly `version` (never a poisoned one)."""
        st = self._ws_state()
        dest = st.destination
        # Staging of a later sync may be active: it never touches live memory (host/device).
        with st.lock:
            if dest is not None and (dest.poisoned or dest.version != version):
                return False
            st.serving = True
            return True

    def ws_txn_state(self) -> TxnState:
        st = self._ws_state()
        dest = st.destination
        txn = st.txn
        return TxnState(
            txn=txn.txn if txn else None,
            phase=txn.phase if txn else None,
            pending_version=txn.version if txn else None,
            version=dest.version if dest is not None else (st.version or ""),
            serving=st.serving,
            poisoned=bool(dest.poisoned) if dest is not None else False,
            checksum=txn.checksum if txn else "",
        )

    def ws_observe(self) -> tuple[str | None, bool, bool, dict[str, str], float]:
        """(version, serving, poisoned, checksums, when): what a serving-consistency checker
        reads, atomically; `when` is time.monotonic() at the read (one clock per host), so
        readings of several ranks can be put in order."""
        st = self._ws_state()
        with st.lock:  # never between a pause, the commit's copies and the resume
            poisoned = bool(st.destination.poisoned) if st.destination is not None else False
            return self.ws_version(), st.serving, poisoned, self.ws_checksums(), time.monotonic()


class ProgressWriter:
    """Publishes this rank's progress to the coordinator's store, at most every PROGRESS_INTERVAL_S."""

    def __init__(self, store: dist.Store, group_name: str, rank: int) -> None:
        self._store = store
        self._key = f"{group_name}/progress/{rank}"
        self._last = 0.0

    def maybe_write(self, done_bytes: int, total_bytes: int) -> None:
        now = time.monotonic()
        if now - self._last < PROGRESS_INTERVAL_S and done_bytes < total_bytes:
            return
        self._last = now
        self._store.set(self._key, f"{done_bytes}/{total_bytes}")
