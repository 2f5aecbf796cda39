"""Which destination replicas a sync sends deltas to, and what the deltas came to.

A replica takes deltas only when every one of its ranks reports, after the recovery that starts
each sync (commit.recover -> settle: each rank's own committed version, rolled forward or back
per the commit record), the same committed version and serves it, and every source rank reports
a kept copy of that very version (`ParticipantMeta.kept_version`): that version is the base.
Every other replica takes the same sync in full. Also in full: spec.transport.delta=off, the
NCCL backend (its receives need the exact message size), a relayed plan (a relay forwards what
it staged and keeps no base), `inplace` staging (staging is the live base itself), a rank
that casts on receipt (its live bytes are not the wire's) and a rank that holds no readable base
(`ParticipantMeta.live_base`: a vLLM rank without a kept copy of its committed version, e.g.
after a restart; engines/vllm_delta.py).

The base is a fact the receivers check, not a hope: each rebuilt region is verified against the
checksum of the source's full new region before the commit. A replica whose live bytes differ
from the version it reports fails that check; the coordinator then retries the sync in full, in
the same run (`Coordinator._sync`), and reports `deltaRetried`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sync_runtime.errors import ChecksumMismatch
from sync_runtime.runtime.commit import Dest, replicas_of
from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.report import ReplicaState, ReplicaVersion
from sync_runtime.transfer import RankResult

log = logging.getLogger("weightsync.coordinator")


@dataclass(slots=True)
class DeltaSync:
    """One sync's delta bookkeeping in the coordinator."""

    base: dict[int, str] = field(default_factory=dict)
    """Destination rank -> base version, for the ranks that take deltas (`delta_bases`)."""
    report: dict = field(default_factory=dict)
    """The report's encoding, wire_bytes, full_bytes, changed_fraction (`summary`)."""
    retried: bool = False

    def transfer(self, run: Callable[[], list], reconnect: Callable[[], None]) -> list:
        """`run` the transfer; should a rebuilt region fail its checksum (live bytes that are not
        the reported version), run it again at once, in full, after `reconnect` (a fresh group)."""
        try:
            return run()
        except ChecksumMismatch as e:
            if not self.base:
                raise
            log.warning("a delta sync failed a checksum, redone in full: %s", e)
            self.base, self.retried = {}, True
            reconnect()
            return run()

    def fields(self) -> dict:
        return {**self.report, "delta_retried": self.retried}


def delta_bases(
    spec: WeightSyncSpec,
    dests: Sequence[Dest],
    replicas: Sequence[ReplicaVersion],
    backend: str,
    relay: bool,
    kept: Sequence[str | None],
) -> dict[int, str]:
    """Destination rank -> base version, for the ranks of every replica that takes deltas.
    `kept`: the version each source rank keeps a copy of (ParticipantMeta.kept_version): a base
    must be that of every source rank, else (a restarted source, the first sync) all go in full."""
    if spec.transport.delta == "off" or backend != "gloo" or relay or len(set(kept)) != 1:
        return {}
    held = {
        (r.deployment, r.replica): r.version
        for r in replicas
        if r.state is ReplicaState.SERVING
        and r.version == kept[0]
        and all(v == r.version for v in r.rank_versions)
    }
    out: dict[int, str] = {}
    for (deployment, replica), members in replicas_of(dests).items():
        base = held.get((deployment, replica))
        if base is None or spec.staging_of(deployment) == "inplace":
            continue
        if any(d.p.wire_dtypes or not d.p.meta.live_base for d in members):
            continue
        out.update((d.rank, base) for d in members)
    return out


def summary(results: Sequence[RankResult], dests: Sequence[Dest], bases: dict[int, str]) -> dict:
    """The report's encoding, wire and full payload bytes, and the fraction of the elements
    compared against a base that changed. Encoding: `full` when no transfer went as a delta,
    `delta` when every destination rank took deltas and every transfer in the delta format went
    as one, `mixed` otherwise (a replica in full, or transfers sent dense: no base or no gain)."""
    deltas, dense = sum(r.delta_transfers for r in results), sum(r.dense_transfers for r in results)
    every_rank = {d.rank for d in dests} <= set(bases)
    encoding = "full" if not deltas else "delta" if every_rank and not dense else "mixed"
    elements = sum(r.delta_elements for r in results)
    return {
        "encoding": encoding,
        "wire_bytes": sum(r.wire_bytes for r in results),
        "full_bytes": sum(r.send_bytes for r in results),
        "changed_fraction": sum(r.delta_changed for r in results) / elements if elements else None,
    }
