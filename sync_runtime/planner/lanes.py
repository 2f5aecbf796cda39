"""Symmetric schedule for large plans: one template per destination position, cyclic phases.

The greedy scheduler (schedule.py) fills every receiver every round: ~2.4 M calls for 4096
destination ranks, minutes of CPU. Large fleets are symmetric instead: every replica at a
position needs the same segments (needs grouped by holder set, see pairs.py), from any of
the segment's identical holders. So:

- Lanes. A receiver takes at most `lanes = min(max_fan_in, round_bytes // bucket_bytes)` buckets
  per round, one per lane; a sender serves at most `lanes` streams at once. Both per-round caps
  (bytes and fan-in) then hold by construction.
- Template. Per position, its segments are packed into the lanes (largest first, shortest lane):
  segment S streams its buckets one per round from template round a_S. All templates are
  cycles of the same length L (the longest).
- Phases. Replica j of R at position p of P runs the template shifted by (j + p / P) * L / R
  rounds, modulo L: the replicas reading one holder set at a given time are spread evenly, even
  where positions have identical templates, and no replica takes longer than L.
- Senders. Per holder set, its occupations (replica, segment, start, length) sorted by start
  are dealt round robin over Q = k * h lanes, lane q on holder q mod h: every holder gets the same
  share (send balance), and a lane's occupations must not overlap on the cycle (checked, k grows
  until they do not). A source rank's lanes over all its holder sets must not exceed `lanes`.

Nothing is built per replica but numpy rows. When a check fails, or placement offers same-node
holders (which the greedy chooser prefers), the caller falls back to the greedy path; so it does
for mid-size plans whose lane schedule predicts too far above the floor (`checked`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.planner.columns import grouped, index_dtype
from sync_runtime.planner.config import PlannerConfig
from sync_runtime.planner.needs import Need
from sync_runtime.planner.pairs import PairBook

LANES_MIN_BUCKETS = 100_000
"""Plans estimated at this many buckets or more try the symmetric schedule (tests lower it)."""
LANES_CHECKED_SPAN = 10
"""Plans under `LANES_MIN_BUCKETS * LANES_CHECKED_SPAN` buckets take the lane schedule only when
its predicted time is within `LANES_MAX_OVER_FLOOR` of the floor, else the greedy one (finer
choices, affordable at that size); larger ones take it whenever it fits (greedy would take
minutes). A test that sets LANES_MIN_BUCKETS to 0 so gets the lane schedule wherever it fits."""
LANES_MAX_OVER_FLOOR = 1.10
Instance = tuple[int, list[Need]]
Occupations = dict[tuple[int, ...], list[tuple[np.ndarray, np.ndarray, int, int, int]]]
"""Per holder set: (starts, dst ranks, bucket count, pattern, bytes) blocks, one per position and segment."""


def estimated_buckets(instances: Sequence[Instance], bucket_bytes: int) -> int:
    per_list: dict[int, int] = {}
    for _, needs in instances:
        if id(needs) not in per_list:
            per_list[id(needs)] = sum(n.nbytes for n in needs) // bucket_bytes + 1
    return sum(per_list[id(needs)] for _, needs in instances)


def checked(instances: Sequence[Instance], config: PlannerConfig) -> bool:
    """Whether a lane schedule for `instances` must also beat `LANES_MAX_OVER_FLOOR` to be taken."""
    limit = LANES_MIN_BUCKETS * LANES_CHECKED_SPAN
    return estimated_buckets(instances, config.effective_bucket_bytes) < limit


def applies(ranks: Sequence[RankCoord], instances: Sequence[Instance], config: PlannerConfig) -> bool:
    """Large enough to need it, and no destination shares a node with a source rank."""
    if estimated_buckets(instances, config.effective_bucket_bytes) < LANES_MIN_BUCKETS:
        return False
    source_nodes = {c.node for c in ranks if c.role is Role.SOURCE}
    return not any(ranks[dst].node in source_nodes for dst, _ in instances)


def _template(book: PairBook, needs: list[Need], lanes: int) -> tuple[list[int], list[int], list[int], int]:
    """Per segment: its pattern, bucket count and template start (largest first into the shortest
    lane); and the longest lane, which the cycle must cover (packing is not perfectly even)."""
    segs = book.segments(needs)
    patterns = [book.pattern(needs, (s,)) for s in range(len(segs))]
    counts = [len(book.patterns[p].sizes) for p in patterns]
    starts = [0] * len(segs)
    length = [0] * lanes
    for s in sorted(range(len(segs)), key=lambda s: (-counts[s], s)):
        lane = min(range(lanes), key=lambda q: (length[q], q))
        starts[s] = length[lane]
        length[lane] += counts[s]
    return patterns, counts, starts, max(length)


def _stride(starts: np.ndarray, lengths: np.ndarray, cycle: int, h: int, lanes: int) -> int | None:
    """Lanes per holder k such that dealing the (sorted) occupations over k*h lanes never overlaps."""
    m = len(starts)
    k = max(1, -(-int(lengths.sum()) // (cycle * h)))
    i = np.arange(m)
    while k <= lanes:
        q = k * h
        if q >= m:
            return k
        nxt = i + q
        gap = starts[nxt % m] - starts + np.where(nxt >= m, cycle, 0)
        if bool((gap >= lengths).all()):
            return k
        k += 1
    return None


def lane_schedule(
    book: PairBook, instances: Sequence[Instance], n_ranks: int, config: PlannerConfig
) -> tuple[int, list[np.ndarray]] | None:
    """Files every pair in `book` and returns (rounds, [round, src, dst, pair, k] rows in round
    order), or None (nothing filed) when the symmetric schedule does not fit."""
    lanes = max(1, min(config.max_fan_in, config.round_bytes // config.effective_bucket_bytes))
    positions: dict[int, tuple[list[Need], list[int]]] = {}
    for dst, needs in instances:
        positions.setdefault(id(needs), (needs, []))[1].append(dst)
    templates = {key: _template(book, needs, lanes) for key, (needs, _) in positions.items()}
    # The longest packed lane, not sum/lanes: a lane longer than the cycle would wrap onto its own
    # start, giving a receiver more than `lanes` buckets (and peers) in one round.
    cycle = max(max((longest for *_, longest in templates.values()), default=0), 1)
    filed = _deal(_occupations(book, positions, templates, cycle), cycle, lanes, n_ranks)
    if filed is None:
        return None
    src, dst, pattern, start = filed
    return cycle, _rows(book, src, dst, pattern, start, cycle)


def _occupations(
    book: PairBook,
    positions: dict[int, tuple[list[Need], list[int]]],
    templates: dict[int, tuple[list[int], list[int], list[int], int]],
    cycle: int,
) -> Occupations:
    """Per holder set, the blocks its segments occupy: each replica's template shifted by its phase."""
    occupations: Occupations = {}
    n_positions = len(positions)
    for index, (key, (needs, dsts)) in enumerate(positions.items()):
        patterns, counts, starts, _ = templates[key]
        # Replica j at position `index`: shifted by (j + index / positions) replica spacings, so
        # positions whose templates coincide (symmetric shards) do not all start a holder set's
        # segment in the same round either.
        spacing = len(dsts) * n_positions
        phase = ((np.arange(len(dsts), dtype=np.int64) * n_positions + index) * cycle) // spacing
        dst_arr = np.asarray(dsts, dtype=np.int64)
        for (ranks, _), p, n, a in zip(book.segments(needs), patterns, counts, starts, strict=True):
            if n:
                block = ((a + phase) % cycle, dst_arr, n, p, sum(book.patterns[p].sizes))
                occupations.setdefault(ranks, []).append(block)
    return occupations


def _columns(blocks: list[tuple]) -> tuple[np.ndarray, ...]:
    """starts, dsts, lengths, patterns, bytes of one holder set's occupations."""
    starts = np.concatenate([b[0] for b in blocks])
    dsts = np.concatenate([b[1] for b in blocks])
    rest = (np.concatenate([np.full(len(b[0]), b[c], dtype=np.int64) for b in blocks]) for c in (2, 3, 4))
    return (starts, dsts, *rest)


def _heavy(cols: tuple[np.ndarray, ...], ranks: tuple[int, ...], cycle: int, lanes: int) -> np.ndarray | None:
    """Holders dealt round robin over k lanes per holder (a set busy enough to use all holders):
    per occupation, its holder's position in `ranks`."""
    starts, lengths = cols[0], cols[2]
    order = np.argsort(starts, kind="stable")
    h = len(ranks)
    k = _stride(starts[order], lengths[order], cycle, h, lanes)
    if k is None:
        return None
    holder = np.empty(len(order), dtype=np.int64)
    holder[order] = (np.arange(len(order)) % (k * h)) % h
    return holder


def _light(
    cols: tuple[np.ndarray, ...],
    ranks: tuple[int, ...],
    cycle: int,
    lanes: int,
    busy: _BusyRows,
    load: np.ndarray,
) -> np.ndarray | None:
    """Per occupation (by start), the least-loaded holder with a free lane all along it. A set
    that needs fewer lanes than it has holders must not reserve a lane on each of them (dense
    and replicated tensors: 64 or 512 holders, two or three streams at a time).

    Plain Python over a heap: ~600k occupations at 4096 destinations, where numpy calls on tiny
    arrays cost ~14 us each. Heap entries are load * width + holder position, one int: ordered
    as (load, position) tuples (ties go to the earlier holder, as argmin) but compared and
    stored without a tuple each."""
    order = np.argsort(cols[0], kind="stable")
    width = len(ranks)
    heap = [int(load[r]) * width + i for i, r in enumerate(ranks)]
    heapq.heapify(heap)
    rows = [busy.row(r) for r in ranks]
    picked: list[int] = []  # holder positions, in start order
    for s, n, nbytes in zip(*(c[order].tolist() for c in (cols[0], cols[2], cols[4])), strict=True):
        key = heap[0]
        row = rows[key % width]
        if n == 1 and row[s] < lanes:  # most light occupations: one bucket, least loaded free
            row[s] += 1
            heapq.heapreplace(heap, key + nbytes * width)
            picked.append(key % width)
            continue
        skipped: list[int] = []
        while heap and not _free(rows[heap[0] % width], s, n, cycle, lanes):
            skipped.append(heapq.heappop(heap))  # the least loaded almost always has a free lane
        if not heap:
            return None
        key = heap[0]
        _occupy(rows[key % width], s, n, cycle)
        heapq.heapreplace(heap, key + nbytes * width)
        for entry in skipped:
            heapq.heappush(heap, entry)
        picked.append(key % width)
    for key in heap:
        load[ranks[key % width]] = key // width
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.asarray(ranks, dtype=np.int64)[picked]
    return out


class _BusyRows:
    """Streams per (source rank, cycle round) as Python lists, made on first use (light sets
    touch a few hundred rows, one element at a time: numpy indexing would dominate)."""

    def __init__(self, busy: np.ndarray):
        self._busy = busy
        self._rows: dict[int, list[int]] = {}

    def row(self, rank: int) -> list[int]:
        found = self._rows.get(rank)
        if found is None:
            found = self._rows[rank] = self._busy[rank].tolist()
        return found


def _free(row: list[int], start: int, n: int, cycle: int, lanes: int) -> bool:
    """Whether `row` has a lane free in every round of [start, start + n) (cyclic)."""
    if n == 1:  # most light occupations (one bucket): no slice to build
        return row[start] < lanes
    end = start + n
    if end <= cycle:
        return max(row[start:end]) < lanes
    return max(max(row[start:]), max(row[: end - cycle])) < lanes


def _occupy(row: list[int], start: int, n: int, cycle: int) -> None:
    if n == 1:
        row[start] += 1
        return
    for t in range(start, start + n):
        row[t % cycle] += 1


def _deal(
    occupations: Occupations, cycle: int, lanes: int, n_ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Per occupation, its holder: pair columns src, dst, pattern, start (in receiver order).

    Busy sets first, dealt over whole lanes (balanced by construction); then the per-round
    lane counts they leave are what the light sets may use, greedily."""
    sets = [(ranks, _columns(blocks)) for ranks, blocks in occupations.items()]
    light = [-(-int(c[2].sum()) // cycle) < len(r) for r, c in sets]
    load = np.zeros(n_ranks, dtype=np.int64)
    # Streams per (holder rank, round), added set by set: a flat bincount over all heavy buckets
    # would build two ~8 M arrays (fresh pages cost as much as the counting). Rows of ranks no
    # set holds stay untouched zero pages.
    top = 1 + max((max(ranks) for ranks in occupations), default=-1)
    busy = np.zeros((top, cycle), dtype=np.int32)
    out: list[tuple[np.ndarray, ...]] = []
    for (ranks, cols), is_light in zip(sets, light, strict=True):
        if is_light:
            continue
        holder = _heavy(cols, ranks, cycle, lanes)
        if holder is None:
            return None
        starts, lengths = cols[0], cols[2]
        rounds = (np.repeat(starts, lengths) + _within(lengths)) % cycle
        streams = np.bincount(np.repeat(holder, lengths) * cycle + rounds, minlength=len(ranks) * cycle)
        held = np.asarray(ranks, dtype=np.int64)
        busy[held] += streams.reshape(len(ranks), cycle).astype(np.int32)
        src = held[holder]
        load += np.bincount(src, weights=cols[4], minlength=n_ranks).astype(np.int64)
        out.append((src, cols[1], cols[3], cols[0]))
    if busy.max(initial=0) > lanes:
        return None
    rows = _BusyRows(busy)
    for (ranks, cols), is_light in zip(sets, light, strict=True):
        if is_light:
            src = _light(cols, ranks, cycle, lanes, rows, load)
            if src is None:
                return None
            out.append((src, cols[1], cols[3], cols[0]))
    cols4 = [np.concatenate([o[c] for o in out]) if out else np.zeros(0, dtype=np.int64) for c in range(4)]
    # Pairs in receiver order, as the greedy path files them (stable: segment order kept).
    by_dst, _ = grouped(cols4[1], n_ranks)
    src, dst, pattern, start = (c[by_dst] for c in cols4)
    return src, dst, pattern, start


def _within(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of `counts`, concatenated."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _rows(
    book: PairBook, src: np.ndarray, dst: np.ndarray, pattern: np.ndarray, start: np.ndarray, cycle: int
) -> list[np.ndarray]:
    """File the pairs in `book` and expand them to bucket rows, sorted by round (stable: pair,
    then bucket order within a round): round, src, dst, pair, k (columns.index_dtype).

    Every bucket-sized array here is fresh memory (page faults cost as much as the arithmetic at
    8.5 M buckets), so columns and temporaries are 32-bit where they fit and updated in place;
    one gather runs over all buckets (their pair), the other columns come from per-pair arrays,
    which stay in cache."""
    first = len(book.pair_src)
    book.pair_src.extend(src.tolist())
    book.pair_dst.extend(dst.tolist())
    book.pair_pattern.extend(pattern.tolist())
    counts = np.asarray([len(p.sizes) for p in book.patterns], dtype=np.int64)[pattern]
    total = int(counts.sum())
    largest_rank = max(int(src.max(initial=0)), int(dst.max(initial=0)))
    narrow = index_dtype(max(total, cycle, first + len(src), largest_rank))
    # Bucket b of the concatenation is bucket b - offset[p] of its pair p, in round start[p] + that.
    offsets = np.cumsum(counts) - counts
    rnd = np.repeat((start - offsets).astype(narrow), counts)
    rnd += np.arange(total, dtype=narrow)
    rnd %= cycle
    order, at = grouped(rnd, cycle)
    del rnd
    local = np.repeat(np.arange(len(src), dtype=narrow), counts)[order]
    del order
    rnd_sorted = np.repeat(np.arange(cycle, dtype=narrow), np.diff(at))
    k = rnd_sorted - start.astype(narrow)[local]
    k %= cycle
    src_rows, dst_rows = src.astype(narrow)[local], dst.astype(narrow)[local]
    local += first  # in place: the pair's index in `book`
    return [rnd_sorted, src_rows, dst_rows, local, k]
