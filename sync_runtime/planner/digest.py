"""The plan digest: sha256 over a canonical encoding of the planner's inputs and its schedule.

Stable across processes and machines: only JSON of strings and integers and fixed-width integer
arrays are hashed (never Python's randomised `hash()`). The schedule fingerprint (per bucket:
round, ranks, bytes, transfer count) makes two participants that somehow planned differently
disagree even when their inputs look the same.

The plan is computed once and reused across syncs, but how each sync is encoded is not: a
destination replica takes deltas from its base version only when it holds that version, which
changes from sync to sync. `sync_digest` extends the plan digest with that decision; the ranks
agree on it before the first byte of each sync.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np

from sync_runtime.core.manifest import Manifest
from sync_runtime.planner.config import PlannerConfig, SideSpec

PLANNER_VERSION = "2"
"""Bump when the planner's output for the same inputs changes."""


DIGEST_SLICE = 1 << 18
"""Elements of a schedule column widened to int64 at once (2 MiB, reused slice to slice)."""


def _side(side: SideSpec) -> dict:
    coords = [
        [
            c.role.value,
            c.replica,
            c.tp_rank,
            c.pp_rank,
            c.dp_rank,
            c.cp_rank,
            c.ep_rank,
            c.etp_rank,
            c.edp_rank,
            c.node,
            c.device,
        ]
        for c in side.coords
    ]
    spec = dataclasses.asdict(side.spec)
    spec["layer_counts"] = None if side.spec.layer_counts is None else list(side.spec.layer_counts)
    side_doc = {"layout": side.layout, "spec": spec, "coords": coords}
    if side.mtp:  # only then: digests of plans without MTP stay what they were
        side_doc["mtp"] = True
    return side_doc


def inputs_encoding(manifest: Manifest, sides: Sequence[SideSpec], config: PlannerConfig) -> bytes:
    doc = {
        "planner": PLANNER_VERSION,
        "family": manifest.family,
        "tensors": [[t.name, list(t.shape), t.dtype] for t in manifest.tensors],
        "sides": [_side(s) for s in sides],
        "config": {
            "bucket_bytes": config.bucket_bytes,
            "staging_budget_bytes": config.staging_budget_bytes,
            "max_fan_in": config.max_fan_in,
            "relay": config.relay,
            "cost": [
                repr(config.cost.nic_bytes_per_s),
                repr(config.cost.intra_node_bytes_per_s),
                repr(config.cost.latency_s),
            ],
        },
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def plan_digest(inputs: bytes, schedule: Sequence[np.ndarray]) -> str:
    """sha256 of the input encoding and the schedule fingerprint's columns (little-endian int64,
    one column after another). Narrower columns are widened a slice at a time: a whole 8.5 M
    bucket column widened at once would be 68 MB of fresh memory per column."""
    h = hashlib.sha256()
    h.update(inputs)
    for column in schedule:
        for at in range(0, len(column), DIGEST_SLICE):
            part = column[at : at + DIGEST_SLICE]
            h.update(memoryview(np.ascontiguousarray(part, dtype="<i8")))
    return h.hexdigest()


def sync_digest(
    plan_digest: str, direct_min_bytes: int, delta_format: str, base_for: Mapping[int, str]
) -> str:
    """What every rank of one sync agrees on before the first byte: the plan digest, the direct
    threshold (it decides which transfers travel as their own message) and the encoding of the
    sync: for each destination rank that takes deltas its base version, in `delta_format`
    (every rank of a replica has the same base: the replica's); any rank not listed takes the
    sync in full. Two ranks that disagree on any replica's encoding or base disagree here, so
    the group refuses the sync instead of mis-framing its messages."""
    doc = {
        "plan": plan_digest,
        "direct_min_bytes": int(direct_min_bytes),
        "delta": {"format": delta_format, "bases": sorted([int(r), v] for r, v in base_for.items())}
        if base_for
        else None,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
