"""Choosing one sender among identical source copies (DP/EDP replicas, tied embedding copies).

Greedy least-loaded over the items largest first (LPT), starting from the loads the items with a
single holder force. A holder on the receiver's node is preferred when its load is at most one
item above the least-loaded holder: intra-node links are ~10x faster and spare the NIC, while the
balance stays within one item of the greedy optimum.
"""

from __future__ import annotations

from collections.abc import Sequence

from sync_runtime.planner.needs import Need


class SenderChooser:
    """Accumulates per-rank send load while choosing senders for destination instances."""

    def __init__(self, nodes: Sequence[str]):
        index: dict[str, int] = {}
        self._node_ids = [index.setdefault(n, len(index)) for n in nodes]
        self._near: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
        self.loads = [0] * len(nodes)
        self._split: dict[int, tuple[dict[int, int], list[int]]] = {}

    def _presplit(self, needs: list[Need]) -> tuple[dict[int, int], list[int]]:
        """Forced per-rank load and the indices of needs with a choice (once per needs list)."""
        key = id(needs)
        split = self._split.get(key)
        if split is None:
            forced: dict[int, int] = {}
            multi: list[int] = []
            for i, need in enumerate(needs):
                ranks = need.cell.ranks
                if len(ranks) == 1:
                    forced[ranks[0]] = forced.get(ranks[0], 0) + need.nbytes
                else:
                    multi.append(i)
            split = self._split[key] = (forced, multi)
        return split

    def choose(self, instances: Sequence[tuple[int, list[Need]]]) -> list[list[int]]:
        """Per instance (dst_rank, needs), the holder index chosen for each need.

        The needs lists must stay alive while this runs (they are keyed by identity).
        """
        loads = self.loads
        choices: list[list[int]] = []
        items: list[tuple[int, int, int]] = []
        for inst, (_, needs) in enumerate(instances):
            forced, multi = self._presplit(needs)
            for rank, nbytes in forced.items():
                loads[rank] += nbytes
            choices.append([0] * len(needs))
            items.extend((-needs[i].nbytes, inst, i) for i in multi)
        items.sort()
        for neg_bytes, inst, i in items:
            dst_rank, needs = instances[inst]
            ranks = needs[i].cell.ranks
            best, best_load = 0, loads[ranks[0]]
            for h in range(1, len(ranks)):
                if loads[ranks[h]] < best_load:
                    best, best_load = h, loads[ranks[h]]
            near = self._same_node(ranks, dst_rank)
            if near and best not in near:
                # A same-node holder wins if it is at most this item above the least loaded.
                h = min(near, key=lambda h: (loads[ranks[h]], h))
                if loads[ranks[h]] <= best_load - neg_bytes:
                    best = h
            loads[ranks[best]] -= neg_bytes
            choices[inst][i] = best
        return choices

    def _same_node(self, ranks: tuple[int, ...], dst_rank: int) -> tuple[int, ...]:
        """Indices of the holders on `dst_rank`'s node (cached per holder set and node)."""
        node = self._node_ids[dst_rank]
        key = (ranks, node)
        near = self._near.get(key)
        if near is None:
            near = self._near[key] = tuple(h for h, r in enumerate(ranks) if self._node_ids[r] == node)
        return near
