"""`plan_sync`: manifest + source side + destination sides -> SyncPlan (design §5). Pure, no I/O.

Steps: shard every source rank and index its pieces into disjoint source cells (alternative
holders per cell); shard each destination position once per distinct (layout, spec) and cut it
into needs (intersections with the cells, split to the bucket size); instantiate the needs per
destination rank; choose senders (balanced, same-node preferred); pack each pair's transfers into
buckets; optionally chain destination replicas (relay); schedule rounds; digest and stats.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from sync_runtime.core import layouts as _layouts
from sync_runtime.core.cost import floor_seconds_arrays, predict_seconds_arrays
from sync_runtime.core.gc_pause import gc_paused
from sync_runtime.core.layouts.base import Layout, Piece
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.memory import hugepages_unadvised, keep_large_blocks_on_heap
from sync_runtime.core.models import not_synced
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.errors import LayoutError, PlanError, TopologyError
from sync_runtime.planner import lanes as _lanes
from sync_runtime.planner import parts as _parts
from sync_runtime.planner import relay as _relay
from sync_runtime.planner.config import PlannerConfig, SideSpec
from sync_runtime.planner.digest import inputs_encoding, plan_digest
from sync_runtime.planner.fill import refill
from sync_runtime.planner.needs import Need, NeedBuilder
from sync_runtime.planner.pairs import BucketRef, PairBook
from sync_runtime.planner.program import CompactPrograms
from sync_runtime.planner.refine import SourceCell, build_shared_cells
from sync_runtime.planner.schedule import direct_queue, schedule_rounds
from sync_runtime.planner.senders import SenderChooser
from sync_runtime.planner.stats import Fingerprint, plan_stats, schedule_arrays

LayoutLookup = Callable[[str], Layout]
BOTH_PACINGS_MAX_BUCKETS = 20_000
"""Plans up to this many buckets are scheduled with and without pacing (cheap at that size)."""
Instance = tuple[int, list[Need]]
"""A destination rank and the needs of its position."""


def plan_sync(
    manifest: Manifest,
    source: SideSpec,
    destinations: Sequence[SideSpec],
    config: PlannerConfig,
    *,
    layout_lookup: LayoutLookup | None = None,
) -> SyncPlan:
    """Plan moving `manifest`'s weights from `source` to every destination side.

    Global ranks: the source's coords first, then each destination side's, in order.
    `layout_lookup` (default `layouts.get_layout`) resolves layout names; tests pass their own.
    """
    started, started_cpu = time.perf_counter(), time.process_time()
    keep_large_blocks_on_heap()  # many large short-lived arrays (core/memory.py)
    # millions of small acyclic objects (gc_pause.py)
    with gc_paused(), hugepages_unadvised():
        plan = _plan(manifest, source, destinations, config, layout_lookup or _layouts.get_layout)
    # for plan's output and the report: what no destination gets, and MTP where a side gets none
    plan.stats["not_synced"] = not_synced(manifest.config) + plan.stats["mtp_not_sent"]
    plan.stats["plan_seconds"] = time.perf_counter() - started
    plan.stats["plan_cpu_seconds"] = time.process_time() - started_cpu
    return plan


def _plan(
    manifest: Manifest,
    source: SideSpec,
    destinations: Sequence[SideSpec],
    config: PlannerConfig,
    lookup: LayoutLookup,
) -> SyncPlan:
    sides = [source, *destinations]
    _check_sides(source, destinations)
    ranks = tuple(c for side in sides for c in side.coords)
    # The sources hold the MTP part only when a destination serves it (a source layout without
    # MTP rules, Megatron's, is refused then and only then).
    planned = _parts.planned_manifest(manifest, destinations)
    cells = _source_cells(planned, source, lookup(source.layout))
    builder = NeedBuilder(cells, planned.by_name(), config.effective_bucket_bytes)
    manifests = (manifest, planned)
    side_instances = _destination_instances(manifests, destinations, lookup, builder, len(source.coords))
    inputs = inputs_encoding(planned, sides, config)
    plans = []
    for chains in _relay.candidate_chains(config, destinations, ranks, side_instances):
        plans.append(_build(ranks, side_instances, chains, config, inputs, len(planned.tensors)))
    plan = min(plans, key=lambda p: (p.stats["predicted_seconds"], p.relay))
    shared = [_parts.shared_with_target(lookup(d.layout), planned) for d in destinations]
    plan.stats.update(_parts.part_stats(manifest, destinations, side_instances, shared))
    return plan


def _check_sides(source: SideSpec, destinations: Sequence[SideSpec]) -> None:
    if not destinations:
        raise PlanError("no destination side: a sync needs at least one")
    if not source.coords:
        raise TopologyError("the source side has no ranks")
    for i, side in enumerate(destinations):
        if not side.coords:
            raise TopologyError(f"destination side {i} ({side.layout}) has no ranks")
        if side.spec.cp != 1:
            raise TopologyError(
                f"destination side {i} ({side.layout}): cp={side.spec.cp}, destinations have no CP"
            )
    seen: set[tuple] = set()
    for side, role in [(source, Role.SOURCE), *((d, Role.DESTINATION) for d in destinations)]:
        for c in side.coords:
            if c.role is not role:
                raise TopologyError(f"rank {c}: role {c.role.value} on the {role.value} side")
            key = (id(side), *c.key, c.ep_rank, c.etp_rank)
            if key in seen:
                raise TopologyError(f"rank {c} appears twice on its side")
            seen.add(key)


def _source_cells(manifest: Manifest, source: SideSpec, layout: Layout) -> dict[str, list[SourceCell]]:
    layout.validate(manifest, source.spec)
    # Ranks grouped by the pieces tuple their shard returns: layouts cache shards by the
    # coordinates that matter, so DP copies share one tuple (kept alive here, so ids stay unique).
    groups: dict[int, tuple[Sequence[Piece], list[int]]] = {}
    for rank, coord in enumerate(source.coords):
        pieces = layout.shard(manifest, source.spec, coord).pieces
        groups.setdefault(id(pieces), (pieces, []))[1].append(rank)
    cells = build_shared_cells((ranks, pieces) for pieces, ranks in groups.values())
    for t in manifest.tensors:
        if t.name not in cells:
            raise LayoutError(f"tensor {t.name}: source layout {source.layout} holds no piece of it")
    return cells


def _position(coord: RankCoord) -> tuple[int, ...]:
    """A destination rank's coordinate without replica, node and device: what its shard depends on."""
    return (coord.tp_rank, coord.pp_rank, coord.dp_rank, coord.ep_rank, coord.etp_rank, coord.edp_rank)


def _destination_instances(
    manifests: tuple[Manifest, Manifest],
    destinations: Sequence[SideSpec],
    lookup: LayoutLookup,
    builder: NeedBuilder,
    first_rank: int,
) -> list[list[Instance]]:
    """Per destination side, its (global rank, needs) in coord order; needs shared per position.
    `manifests`: (without, with) the MTP part; a side shards the one it holds."""
    cache: dict[tuple, list[Need]] = {}
    out: list[list[Instance]] = []
    rank = first_rank
    for index, side in enumerate(destinations):
        manifest = manifests[side.mtp]
        layout = lookup(side.layout)
        layout.validate(manifest, side.spec)
        spec_key = dataclasses.replace(side.spec, replicas=1)
        instances: list[Instance] = []
        for coord in side.coords:
            key = (side.layout, spec_key, side.mtp, _position(coord))
            needs = cache.get(key)
            if needs is None:
                where = f"destination {index} ({side.layout}) rank {rank} {_describe(coord)}"
                needs = cache[key] = builder.needs(layout.shard(manifest, side.spec, coord), where)
            instances.append((rank, needs))
            rank += 1
        out.append(instances)
        _check_destination_covers(
            manifest, side, index, instances, _parts.shared_with_target(layout, manifest)
        )
    return out


def _check_destination_covers(
    manifest: Manifest, side: SideSpec, index: int, instances: list[Instance], shared: frozenset[str]
) -> None:
    """Every tensor is held by some rank, but those the layout shares with the target (MTP)."""
    held = {n.tensor for needs in {id(n): n for _, n in instances}.values() for n in needs}
    for t in manifest.tensors:
        if t.name not in held and t.name not in shared:
            raise LayoutError(
                f"tensor {t.name}: destination {index} layout {side.layout} holds no piece of it"
            )


def _describe(coord: RankCoord) -> str:
    dp = f", dp={coord.dp_rank}" if coord.dp_rank else ""
    return f"(replica={coord.replica}, pp={coord.pp_rank}{dp}, tp={coord.tp_rank}, ep={coord.ep_rank})"


def _build(
    ranks: tuple[RankCoord, ...],
    side_instances: list[list[Instance]],
    chains: dict[int, int],
    config: PlannerConfig,
    inputs: bytes,
    n_tensors: int,
) -> SyncPlan:
    """One complete plan; `chains` maps relayed destination ranks to their forwarders."""
    direct = [inst for insts in side_instances for inst in insts if inst[0] not in chains]
    programs, scheduler = _programs(ranks, direct, chains, config)
    book = programs.book
    schedule = _fingerprint(programs)
    plan = SyncPlan(
        ranks=ranks,
        digest=plan_digest(inputs + book.content_hash(), schedule),
        relay=bool(chains),
        programs=programs,
    )
    per_list: dict[int, int] = {}  # needs lists are shared per position: sum each once
    for insts in side_instances:
        for _, needs in insts:
            if id(needs) not in per_list:
                per_list[id(needs)] = sum(n.nbytes for n in needs)
    lower_bound = sum(per_list[id(needs)] for insts in side_instances for _, needs in insts)
    plan.stats.update(plan_stats(plan, schedule, n_tensors, lower_bound, config.cost))
    plan.stats["scheduler"] = scheduler
    return plan


def _programs(
    ranks: tuple[RankCoord, ...], direct: list[Instance], chains: dict[int, int], config: PlannerConfig
) -> tuple[CompactPrograms, str]:
    """Pairs and rounds: the symmetric lane schedule where it applies and fits, else greedy."""
    if not chains and _lanes.applies(ranks, direct, config):
        found = _lane_programs(ranks, direct, config)
        if found is not None:
            return found, "lanes"
    book = PairBook(config.effective_bucket_bytes)
    choices = SenderChooser([c.node for c in ranks]).choose_groups(direct)
    for (dst, needs), choice in zip(direct, choices, strict=True):
        book.add(dst, needs, choice)
    rounds = _schedule(ranks, book, chains, config)
    return CompactPrograms.from_refs(book, rounds), "greedy"


def _lane_programs(
    ranks: tuple[RankCoord, ...], direct: list[Instance], config: PlannerConfig
) -> CompactPrograms | None:
    """The lane schedule's programs, or None where it does not fit (or, for a plan small enough
    to schedule greedily, predicts more than `LANES_MAX_OVER_FLOOR` times the floor)."""
    book = PairBook(config.effective_bucket_bytes)
    filled = refill(direct, config.effective_bucket_bytes)
    found = _lanes.lane_schedule(book, filled, len(ranks), config)
    if found is None:
        return None
    n_rounds, cols = found
    programs = CompactPrograms(book, n_rounds, [*cols, np.zeros(len(cols[0]), dtype=bool)])
    if _lanes.checked(filled, config):
        arrays = schedule_arrays(ranks, _fingerprint(programs), n_rounds)
        floor = floor_seconds_arrays(arrays, config.cost)
        if predict_seconds_arrays(arrays, config.cost) > _lanes.LANES_MAX_OVER_FLOOR * floor:
            return None
    return programs


def _schedule(
    ranks: Sequence[RankCoord], book: PairBook, chains: dict[int, int], config: PlannerConfig
) -> list[list[BucketRef]]:
    """Rounds of bucket refs. Pacing (see schedule.py) wins on large uniform plans and can lose on
    small ones where a few rounds decide; small plans are scheduled both ways."""
    n_pairs = len(book.pair_src)
    n_buckets = sum(len(book.patterns[p].sizes) for p in book.pair_pattern)
    best: tuple[float, list[list[BucketRef]]] | None = None
    for pacing in (True, False) if n_buckets <= BOTH_PACINGS_MAX_BUCKETS else (True,):
        queues = [direct_queue(book.pair_src[p], book.pair_dst[p], book.refs(p)) for p in range(n_pairs)]
        relays = _relay.relay_queues(chains, queues)
        rounds = schedule_rounds(
            queues, len(ranks), config.round_bytes, config.max_fan_in, relays, pacing=pacing
        )
        rows = [(i, b.src_rank, b.dst_rank, b.nbytes) for i, r in enumerate(rounds) for b in r]
        schedule = np.array(rows, dtype=np.int64).reshape(-1, 4).T
        predicted = predict_seconds_arrays(schedule_arrays(ranks, schedule, len(rounds)), config.cost)
        if best is None or predicted < best[0]:
            best = (predicted, rounds)
    assert best is not None
    return best[1]


def _fingerprint(programs: CompactPrograms) -> Fingerprint:
    """Per bucket: round, src, dst, bytes, transfer count (the schedule, for digest and stats)."""
    sizes, counts = programs.bucket_tables()
    return programs.round, programs.src, programs.dst, sizes, counts


__all__ = ["plan_sync"]
