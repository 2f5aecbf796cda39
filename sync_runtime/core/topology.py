"""Parallel topologies and rank coordinates (docs/design.md, sections 4 and 5).

A topology is the user's declared parallelism of one side of a sync. Coordinates of a real
participant are reported by the participant itself; `enumerate_ranks` gives the canonical
enumeration used when planning without participants (CLI, tests) and to check that the
reported coordinates cover the declared topology exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from enum import StrEnum

from sync_runtime.errors import TopologyError


class Role(StrEnum):
    SOURCE = "source"
    DESTINATION = "destination"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec:
    """Declared parallelism of one side of a sync."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    dp: int = 1
    """Data-parallel size. Source: identical dense copies. Destination: the data-parallel engines
    of one replica in vLLM's wide EP only (`ep == tp * dp`: experts split over all dp*tp ranks,
    the rest TP-sharded and identical on every DP rank); independent engines are `replicas`."""
    cp: int = 1
    """Context-parallel size (source only): CP ranks split the sequence, not the weights, so the
    cp ranks of one (pp, dp, tp) position hold identical shards and are alternative senders."""
    ep: int = 1
    """Expert-parallel size. Source: experts split over ep ranks inside tp*dp; destination: 1, tp
    (EP inside TP) or tp*dp (wide EP)."""
    etp: int = 1
    """Expert-tensor-parallel size (source only)."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (source only)."""
    replicas: int = 1
    """Destination data-parallel replicas (independent inference engines)."""
    layer_counts: tuple[int, ...] | None = None
    """Explicit per-stage layer counts for uneven PP splits; None = even split."""

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "replicas"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{field}={value!r}: must be an integer >= 1")
        if self.layer_counts is not None:
            if len(self.layer_counts) != self.pp:
                raise TopologyError(
                    f"layer_counts has {len(self.layer_counts)} entries, pp={self.pp} needs one per stage"
                )
            if any(c < 1 for c in self.layer_counts):
                raise TopologyError(f"layer_counts={list(self.layer_counts)}: every stage needs >= 1 layer")

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def world_size(self) -> int:
        return self.ranks_per_replica * self.replicas

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: identical copies of each expert shard inside one PP stage
        (Megatron-Core regroups the stage's tp*cp*dp ranks as etp x ep x edp)."""
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)

    @classmethod
    def parse(cls, text: str) -> ParallelSpec:
        """Parse "tp=8,pp=8,dp=4,cp=2,ep=32,etp=1" (also "layers=8+8+7" for explicit stage sizes)."""
        values: dict[str, object] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip().casefold()  # "TP=2" is tp=2
            if not sep:
                raise TopologyError(f"{item!r}: expected key=value")
            if key in ("layers", "layer_counts"):
                try:
                    values["layer_counts"] = tuple(int(x) for x in raw.split("+"))
                except ValueError as e:
                    raise TopologyError(f"{item!r}: layers must look like 8+8+7") from e
                continue
            if key not in names:
                raise TopologyError(f"{item!r}: unknown key {key!r} (known: {', '.join(sorted(names))})")
            try:
                values[key] = int(raw)
            except ValueError as e:
                raise TopologyError(f"{item!r}: {key} must be an integer") from e
        return cls(**values)  # type: ignore[arg-type]

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        for key, default in (("dp", 1), ("cp", 1), ("ep", 1), ("etp", 1), ("vpp", 1), ("replicas", 1)):
            if getattr(self, key) != default:
                parts.append(f"{key}={getattr(self, key)}")
        if self.layer_counts is not None:
            parts.append("layers=" + "+".join(map(str, self.layer_counts)))
        return ",".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoord:
    """Where one participant sits in its side's topology. Reported by the participant."""

    role: Role
    replica: int = 0
    """Destination replica index (0 for the source)."""
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    """Context-parallel rank (source only)."""
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    node: str = "node-0"
    device: str = "cpu"

    @property
    def key(self) -> tuple[str, int, int, int, int, int]:
        """Identity of the rank inside its side (what must be unique); sorts in global-rank order."""
        return (self.role.value, self.replica, self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank)


def source_expert_coords(
    spec: ParallelSpec, tp_rank: int, dp_rank: int, cp_rank: int = 0
) -> tuple[int, int, int]:
    """(ep_rank, etp_rank, edp_rank) of a source rank, Megatron's "tp-ep-dp" expert order.

    Inside one PP stage the tp*cp*dp ranks (dense order tp, cp, dp: Megatron's "tp-cp-ep-dp-pp")
    are regrouped for expert layers as etp x ep x edp, etp fastest: local index
    l = tp_rank + tp * (cp_rank + cp * dp_rank).
    """
    local = tp_rank + spec.tp * (cp_rank + spec.cp * dp_rank)
    return (local // spec.etp) % spec.ep, local % spec.etp, local // (spec.etp * spec.ep)


def check_destination(spec: ParallelSpec) -> None:
    """A destination's shape: no context parallelism; a data-parallel axis only as vLLM's wide EP
    (experts over all tp*dp ranks of one replica, no pipeline stages)."""
    if spec.cp != 1:
        raise TopologyError(f"cp={spec.cp}: context parallelism is a source-side axis (destinations: cp=1)")
    if spec.dp > 1 and (spec.ep != spec.tp * spec.dp or spec.pp != 1):
        raise TopologyError(
            f"destination dp={spec.dp} is vLLM's wide EP only: it needs ep=tp*dp={spec.tp * spec.dp} "
            f"and pp=1 (got ep={spec.ep}, pp={spec.pp}); independent engines are replicas"
        )


def destination_ep_rank(spec: ParallelSpec, tp_rank: int, dp_rank: int = 0) -> int:
    """A destination rank's EP rank: vLLM flattens TP across DP for its fused MoE layers
    (FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp, vLLM 0.32: dp_rank * tp + tp_rank;
    its EP group orders the ranks the same way, parallel_state.initialize_model_parallel)."""
    return dp_rank * spec.tp + tp_rank if spec.ep > 1 else 0


def enumerate_ranks(spec: ParallelSpec, role: Role, gpus_per_node: int = 8) -> list[RankCoord]:
    """Canonical ranks of one side, in Megatron's tp-fastest order, placed gpus_per_node per node.

    Source order: tp, cp, dp, pp (global = tp + tp*(cp + cp*(dp + dp*pp))). Destination order
    per replica: tp, pp, dp (the order a vLLM server's workers report: engines/vllm_worker.py);
    replicas outermost. Destinations have ep == tp (EP inside TP) or ep == 1, and no context
    parallelism; dp > 1 is vLLM's wide EP (`check_destination`).
    """
    coords: list[RankCoord] = []
    if role is Role.SOURCE:
        for pp_rank, dp_rank, cp_rank, tp_rank in itertools.product(
            range(spec.pp), range(spec.dp), range(spec.cp), range(spec.tp)
        ):
            ep_rank, etp_rank, edp_rank = source_expert_coords(spec, tp_rank, dp_rank, cp_rank)
            coords.append(
                RankCoord(
                    role=role,
                    tp_rank=tp_rank,
                    pp_rank=pp_rank,
                    dp_rank=dp_rank,
                    cp_rank=cp_rank,
                    ep_rank=ep_rank,
                    etp_rank=etp_rank,
                    edp_rank=edp_rank,
                )
            )
    else:
        check_destination(spec)
        for replica, dp_rank, pp_rank, tp_rank in itertools.product(
            range(spec.replicas), range(spec.dp), range(spec.pp), range(spec.tp)
        ):
            coords.append(
                RankCoord(
                    role=role,
                    replica=replica,
                    tp_rank=tp_rank,
                    pp_rank=pp_rank,
                    dp_rank=dp_rank,
                    ep_rank=destination_ep_rank(spec, tp_rank, dp_rank),
                )
            )
    return [
        dataclasses.replace(
            c, node=f"{role.value}-node-{i // gpus_per_node}", device=f"cuda:{i % gpus_per_node}"
        )
        for i, c in enumerate(coords)
    ]


def stage_layer_ranges(num_layers: int, pp: int, layer_counts: tuple[int, ...] | None = None) -> list[range]:
    """Global layer range of each PP stage (design §4.1/4.2: first L % p stages get one extra layer)."""
    if pp > num_layers:
        raise TopologyError(f"pp={pp} has more stages than the model's {num_layers} layers")
    if layer_counts is None:
        base, extra = divmod(num_layers, pp)
        layer_counts = tuple(base + (1 if s < extra else 0) for s in range(pp))
    elif sum(layer_counts) != num_layers:
        raise TopologyError(
            f"layer_counts={list(layer_counts)} sum to {sum(layer_counts)}, the model has {num_layers} layers"
        )
    ranges, start = [], 0
    for count in layer_counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
