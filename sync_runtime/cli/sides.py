"""The destination sides of `plan`/`simulate` from their flags: --dst, --dst-layout, --dst-mtp."""

from __future__ import annotations

import argparse
import dataclasses

from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.errors import PlanError
from sync_runtime.planner import SideSpec


def _per_destination(values: list[str] | None, default: str, n: int, flag: str) -> list[str]:
    """One value per --dst: `values` given once (for all) or once per --dst; `default` if absent."""
    values = values or [default]
    if len(values) not in (1, n):
        raise PlanError(f"{len(values)} {flag} for {n} --dst: give one, or one per --dst")
    return values * n if len(values) == 1 else values


def destination_sides(args: argparse.Namespace) -> list[SideSpec]:
    """A side per --dst; several are kept on separate nodes, as separate deployments are."""
    n = len(args.dst)
    layouts = _per_destination(args.dst_layout, "vllm", n, "--dst-layout")
    # A delegate's Namespace (cli/checks.py) may not carry --dst-mtp: no destination serves MTP.
    mtp = _per_destination(getattr(args, "dst_mtp", None), "off", n, "--dst-mtp")
    sides = []
    for i, text in enumerate(args.dst):
        spec = ParallelSpec.parse(text)
        coords = enumerate_ranks(spec, Role.DESTINATION, args.gpus_per_node)
        if n > 1:
            coords = [
                dataclasses.replace(c, node=c.node.replace("destination", f"destination{i}")) for c in coords
            ]
        sides.append(SideSpec(layouts[i], spec, tuple(coords), mtp[i] == "on"))
    return sides
