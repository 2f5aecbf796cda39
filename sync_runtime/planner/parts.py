"""Which parts of the checkpoint each destination side gets (the model; the MTP layers only where
the side serves them), in bytes and one line per side for `plan`'s output and the sync report.

Pure: figures from the needs the plan was built from (a side's bytes are what its ranks
receive, replicated pieces counted on every rank that holds them, as the lower bound counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sync_runtime.core.manifest import MTP_PART, Manifest
from sync_runtime.core.models.config import mtp_layer_count, mtp_span
from sync_runtime.errors import PlanError
from sync_runtime.planner.config import SideSpec
from sync_runtime.planner.needs import Need

NOT_SERVED = "not sent: destination does not serve MTP"


def planned_manifest(manifest: Manifest, destinations: Sequence[SideSpec]) -> Manifest:
    """The manifest the sources must hold: with the MTP part when any destination serves it.
    PlanError when one does and the model has no MTP part to send."""
    serving = [i for i, d in enumerate(destinations) if d.mtp]
    if not serving:
        return manifest
    if not manifest.mtp:
        raise PlanError(
            f"destination {serving[0]} serves MTP, but this {manifest.family} manifest has no MTP part "
            f"(num_nextn_predict_layers={mtp_layer_count(manifest.config)})"
        )
    return manifest.with_mtp()


def shared_with_target(layout: object, manifest: Manifest) -> frozenset[str]:
    """The MTP tensors of `manifest` a destination layout holds no copy of (`mtp_shared`: vLLM's
    drafter uses the target's embedding and lm_head): not sent, and not missing."""
    suffixes = tuple(getattr(layout, "mtp_shared", ()))
    return frozenset(t.name for t in manifest.tensors if t.part == MTP_PART and t.name.endswith(suffixes))


def _side_bytes(instances: Sequence[tuple[int, list[Need]]], mtp_names: frozenset[str]) -> tuple[int, int]:
    """(model bytes, MTP bytes) the side's ranks receive; needs lists are shared per position."""
    per_list: dict[int, tuple[int, int]] = {}
    model = mtp = 0
    for _, needs in instances:
        sums = per_list.get(id(needs))
        if sums is None:
            extra = sum(n.nbytes for n in needs if n.tensor in mtp_names)
            sums = per_list[id(needs)] = (sum(n.nbytes for n in needs) - extra, extra)
        model, mtp = model + sums[0], mtp + sums[1]
    return model, mtp


def part_stats(
    manifest: Manifest,
    destinations: Sequence[SideSpec],
    side_instances: Sequence[Sequence[tuple[int, list[Need]]]],
    shared: Sequence[frozenset[str]],
) -> dict[str, Any]:
    """`parts` (one line per destination side), `mtp_wire_bytes` (all sides), `side_mtp_bytes`
    (per side), and `mtp_not_sent` (a line per side that serves no MTP of a model that has it).
    `shared`: per side, the MTP tensors its layout shares with the target (`shared_with_target`)."""
    mtp_names = frozenset(t.name for t in (*manifest.tensors, *manifest.mtp) if t.part == MTP_PART)
    n = mtp_layer_count(manifest.config)
    what = f"{n} layer{'s' if n != 1 else ''} ({mtp_span(manifest.config)})"
    lines, not_sent, side_mtp = [], [], []
    for i, (side, instances, own) in enumerate(zip(destinations, side_instances, shared, strict=True)):
        model, mtp = _side_bytes(instances, mtp_names)
        side_mtp.append(mtp)
        head = f"destination {i} ({side.layout}:{side.spec.describe()}): model {model:,} bytes, sent"
        if side.mtp:
            also = f" ({', '.join(sorted(own))}: the target's own, not sent)" if own else ""
            lines.append(f"{head}; mtp: {what}, {mtp:,} bytes, sent{also}")
        elif mtp_names:
            canonical = manifest.part_nbytes(MTP_PART)
            line = f"mtp: {what}, {canonical:,} bytes canonical, {NOT_SERVED}"
            lines.append(f"{head}; {line}")
            not_sent.append(f"destination {i} ({side.layout}:{side.spec.describe()}): {line}")
        else:
            lines.append(head)
    return {
        "parts": lines,
        "mtp_wire_bytes": sum(side_mtp),
        "side_mtp_bytes": side_mtp,
        "mtp_not_sent": not_sent,
    }
