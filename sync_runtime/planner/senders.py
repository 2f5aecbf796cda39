"""Choosing one sender among identical source copies (DP/EDP replicas, tied embedding copies).

Greedy least-loaded over the items largest first (LPT), starting from the loads the needs with a
single holder force. An item is normally everything one destination rank needs from one holder
set (e.g. all its dense bytes of one TP rank's four DP copies): few items, and few sender peers
per receiver, hence few and full buckets. When a holder set serves too few receivers to balance
that way (fewer than `2 * len(holders)`), its needs are items of their own.

A holder on the receiver's node, else one that already sends to the receiver, is preferred when
its load is at most one item above the least loaded holder: intra-node links are ~10x faster and
spare the NIC, and every extra peer costs messages and fan-in slots, while the balance stays
within one item of the greedy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sync_runtime.planner.needs import Need

Choice = dict[tuple[int, ...], "int | dict[int, int]"]
"""Per holder set: one holder index for all of its needs, or one per need index."""

COARSE_FACTOR = 2
"""A holder set with at least this many receivers per holder is balanced per receiver."""


@dataclass(slots=True)
class _Split:
    """A needs list split once: forced loads, and the needs with a choice grouped by holder set."""

    forced: dict[int, int]
    groups: dict[tuple[int, ...], list[int]]
    group_bytes: dict[tuple[int, ...], int]


class SenderChooser:
    """Accumulates per-rank send load while choosing senders for destination instances."""

    def __init__(self, nodes: Sequence[str]):
        index: dict[str, int] = {}
        self._node_ids = [index.setdefault(n, len(index)) for n in nodes]
        self._near: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
        self._splits: dict[int, _Split] = {}
        self._peers: dict[int, set[int]] = {}
        self.loads = [0] * len(nodes)

    def _split(self, needs: list[Need]) -> _Split:
        split = self._splits.get(id(needs))
        if split is None:
            split = self._splits[id(needs)] = _Split({}, {}, {})
            for i, need in enumerate(needs):
                ranks = need.cell.ranks
                if len(ranks) == 1:
                    split.forced[ranks[0]] = split.forced.get(ranks[0], 0) + need.nbytes
                else:
                    split.groups.setdefault(ranks, []).append(i)
                    split.group_bytes[ranks] = split.group_bytes.get(ranks, 0) + need.nbytes
        return split

    def choose(self, instances: Sequence[tuple[int, list[Need]]]) -> list[list[int]]:
        """Per instance (dst_rank, needs), the holder index chosen for each need.

        The needs lists must stay alive while this runs (they are keyed by identity).
        """
        out = []
        for (_, needs), choice in zip(instances, self.choose_groups(instances), strict=True):
            chosen = [0] * len(needs)
            for ranks, members in self._split(needs).groups.items():
                c = choice[ranks]
                for j in members:
                    chosen[j] = c if isinstance(c, int) else c[j]
            out.append(chosen)
        return out

    def choose_groups(self, instances: Sequence[tuple[int, list[Need]]]) -> list[Choice]:
        """Per instance, per holder set with a choice: one holder for all its needs, or (sets with
        too few receivers to balance whole) a holder per need index. Sets of one holder are absent."""
        splits = [self._split(needs) for _, needs in instances]
        receivers: dict[tuple[int, ...], int] = {}
        for split in splits:
            for ranks in split.groups:
                receivers[ranks] = receivers.get(ranks, 0) + 1
        choices: list[Choice] = []
        # (-bytes, need index or -1 for a whole group, instance, holder set): equal sizes alternate
        # between receivers, so a run of one receiver's equal items cannot drift the loads apart.
        items: list[tuple[int, int, int, tuple[int, ...]]] = []
        for inst, ((_, needs), split) in enumerate(zip(instances, splits, strict=True)):
            for rank, nbytes in split.forced.items():
                self.loads[rank] += nbytes
            choice: Choice = {}
            choices.append(choice)
            for ranks, members in split.groups.items():
                if receivers[ranks] >= COARSE_FACTOR * len(ranks):
                    items.append((-split.group_bytes[ranks], -1, inst, ranks))
                else:
                    choice[ranks] = {}
                    items.extend((-needs[i].nbytes, i, inst, ranks) for i in members)
        items.sort()
        for neg_bytes, i, inst, ranks in items:
            best = self._pick(ranks, instances[inst][0], -neg_bytes)
            if i < 0:
                choices[inst][ranks] = best
            else:
                choices[inst][ranks][i] = best  # type: ignore[index]
        return choices

    def _pick(self, ranks: tuple[int, ...], dst_rank: int, nbytes: int) -> int:
        """Index of the holder to send `nbytes` to `dst_rank`; adds the load.

        The least-loaded holder, unless one within `nbytes` of its load is on the receiver's node
        or already sends to the receiver: a new peer costs a message and a fan-in slot per round.
        """
        loads = self.loads
        best, best_load = 0, loads[ranks[0]]
        for h in range(1, len(ranks)):
            if loads[ranks[h]] < best_load:
                best, best_load = h, loads[ranks[h]]
        peers = self._peers.setdefault(dst_rank, set())
        for preferred in (self._same_node(ranks, dst_rank), [h for h, r in enumerate(ranks) if r in peers]):
            if best in preferred:
                break
            if preferred:
                h = min(preferred, key=lambda h: (loads[ranks[h]], h))
                if loads[ranks[h]] <= best_load + nbytes:
                    best = h
                    break
        loads[ranks[best]] += nbytes
        peers.add(ranks[best])
        return best

    def _same_node(self, ranks: tuple[int, ...], dst_rank: int) -> tuple[int, ...]:
        """Indices of the holders on `dst_rank`'s node (cached per holder set and node)."""
        node = self._node_ids[dst_rank]
        key = (ranks, node)
        near = self._near.get(key)
        if near is None:
            near = self._near[key] = tuple(h for h, r in enumerate(ranks) if self._node_ids[r] == node)
        return near
