"""Relay inside the destination fleet: replica k receives its shard from replica k - c.

Destination ranks at the same position of the same (layout, spec) hold identical shards. With
relay, only the first c of them (the chain heads) receive from the source; each other one gets a
copy of every bucket its forwarder receives, one round later (pipelined chains, so every rank
sends its shard at most once). This pays when the source's NICs are the bottleneck: many
replicas fed by few source ranks.

Choosing c: the source side's time shrinks with c/R of the replicas fed directly, while each
chain adds a round of pipeline fill per hop. `relay="auto"` estimates both per c with the link
model, and then plans with and without relay and keeps the faster prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sync_runtime.core.topology import RankCoord
from sync_runtime.planner.config import PlannerConfig, SideSpec
from sync_runtime.planner.needs import Need
from sync_runtime.planner.schedule import PairQueue

Instance = tuple[int, list[Need]]


def _groups(side_instances: Sequence[Sequence[Instance]]) -> list[list[int]]:
    """Destination ranks with identical shards (same needs list), in rank order."""
    groups: dict[int, list[int]] = {}
    for instances in side_instances:
        for rank, needs in instances:
            groups.setdefault(id(needs), []).append(rank)
    return list(groups.values())


def chains_for(groups: list[list[int]], heads: int) -> dict[int, int]:
    """Relayed rank -> forwarder, for `heads` interleaved chains per group."""
    return {g[k]: g[k - heads] for g in groups for k in range(heads, len(g))}


def _estimate(c: int, replicas: int, source_send_s: float, dest_recv_s: float, round_s: float) -> float:
    return max(source_send_s * c / replicas, dest_recv_s) + (math.ceil(replicas / c) - 1) * round_s


def _best_heads(
    config: PlannerConfig, ranks: Sequence[RankCoord], side_instances: Sequence[Sequence[Instance]]
) -> int:
    groups = _groups(side_instances)
    replicas = max(len(g) for g in groups)
    n_src = sum(1 for c in ranks if c.role.value == "source")
    total = sum(n.nbytes for insts in side_instances for _, needs in insts for n in needs)
    recv = max(sum(n.nbytes for n in needs) for insts in side_instances for _, needs in insts)
    nic = config.cost.nic_bytes_per_s
    source_send_s, dest_recv_s = total / n_src / nic, recv / nic
    round_s = config.round_bytes / nic
    costs = {c: _estimate(c, replicas, source_send_s, dest_recv_s, round_s) for c in range(1, replicas + 1)}
    return min(costs, key=lambda c: (costs[c], -c))


def candidate_chains(
    config: PlannerConfig,
    destinations: Sequence[SideSpec],
    ranks: Sequence[RankCoord],
    side_instances: Sequence[Sequence[Instance]],
) -> list[dict[int, int]]:
    """The relay choices to plan: `{}` is no relay."""
    if config.relay == "off":
        return [{}]
    groups = _groups(side_instances)
    replicas = max(len(g) for g in groups)
    if replicas < 2:
        return [{}]
    heads = _best_heads(config, ranks, side_instances)
    if config.relay == "on":
        return [chains_for(groups, min(heads, replicas - 1))]
    return [{}] if heads >= replicas else [{}, chains_for(groups, heads)]


def relay_queues(chains: dict[int, int], queues: Sequence[PairQueue]) -> list[PairQueue]:
    """Empty (forwarder, receiver) queues sized after what the chain head receives directly."""
    received: dict[int, tuple[int, int]] = {}
    for q in queues:
        count, nbytes = received.get(q.dst, (0, 0))
        received[q.dst] = (count + q.total, nbytes + q.remaining)
    out = []
    for receiver, forwarder in chains.items():
        head = forwarder
        while head in chains:
            head = chains[head]
        count, nbytes = received.get(head, (0, 0))
        out.append(PairQueue(forwarder, receiver, [], nbytes, count))
    return out
