"""The two-phase commit record of one sync, kept in the coordinator's TCPStore (design §2.5).

Keys, all under `weightsync-txn/<txn>/` (`txn` is handed to the ranks over the coordinator's
control channel, with a random part, like the group name: a client that can reach the store's
port but was not told the name cannot touch the record):
- `prepared/<rank>`: JSON {version, checksum}: the destination rank received and verified every
  byte of `version` and holds it staged (checksum = `Staging.staged_checksum()`);
- `decision`: `commit:<version>` or `abort`, written once (compare_set: the first writer wins,
  so a coordinator that restarts and one that never died cannot decide differently);
- `committed/<rank>`: the version the rank applied after the decision.

A rank commits only after reading `commit:<version>` here, so one `committed` key proves the
decision was commit: a coordinator that lost the store rolls forward whenever a rank says it
committed, and back otherwise. Participants keep their own copy of their part (`LocalTxn`) so a
new coordinator finds the record, or decides without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch.distributed as dist

COMMIT = "commit"
ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Prepared:
    version: str
    checksum: str


@dataclass(slots=True)
class LocalTxn:
    """A destination rank's own account of its latest transaction (survives a coordinator)."""

    txn: str
    version: str
    phase: str = "staging"
    """staging -> prepared -> committed | aborted."""
    checksum: str = ""


def commit_decision(version: str) -> str:
    return f"{COMMIT}:{version}"


def parse_decision(raw: str | None) -> tuple[str | None, str | None]:
    """(commit|abort|None, version) of a stored decision."""
    if not raw:
        return None, None
    kind, _, version = raw.partition(":")
    if kind == COMMIT and version:
        return COMMIT, version
    if kind == ABORT:
        return ABORT, None
    raise ValueError(f"unreadable commit decision {raw!r}")


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class CommitRecord:
    """One transaction's keys in the store. Every method is one or a few store round trips."""

    def __init__(self, store: dist.Store, txn: str) -> None:
        if not txn or "/" in txn:
            raise ValueError(f"transaction name {txn!r}: must be non-empty and contain no '/'")
        self.txn = txn
        self._store = dist.PrefixStore(f"weightsync-txn/{txn}", store)

    def _get(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return _text(self._store.get(key))

    def prepare(self, rank: int, version: str, checksum: str) -> None:
        self._store.set(f"prepared/{rank}", json.dumps(asdict(Prepared(version, checksum))))

    def prepared(self, ranks: Iterable[int]) -> dict[int, Prepared]:
        out = {}
        for rank in ranks:
            raw = self._get(f"prepared/{rank}")
            if raw is not None:
                out[rank] = Prepared(**json.loads(raw))
        return out

    def decide(self, decision: str) -> str:
        """Write the decision unless one stands already; returns the one that stands."""
        parse_decision(decision)  # refuse to write something no reader understands
        return _text(self._store.compare_set("decision", "", decision))

    def decision(self) -> str | None:
        return self._get("decision")

    def mark_committed(self, rank: int, version: str) -> None:
        self._store.set(f"committed/{rank}", version)

    def committed(self, ranks: Iterable[int]) -> dict[int, str]:
        out = {}
        for rank in ranks:
            raw = self._get(f"committed/{rank}")
            if raw is not None:
                out[rank] = raw
        return out
