"""Check a rank's plan against the tensors it really holds, and its group and staging, before the
first byte moves.

Byte counts are checked in the wire dtype (the plan sizes transfers from the manifest, whose
dtype is the source's); a destination holding a tensor in another dtype must be able to cast to
it (`cast_defined`: float to float). Shapes are checked against the tensors themselves."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sync_runtime.core.layouts.base import Box, box_numel
from sync_runtime.core.manifest import cast_defined
from sync_runtime.core.plan import RankPlan, Transfer
from sync_runtime.errors import ConnectError, PlanMismatchError, StagingError
from sync_runtime.transfer.config import TransferConfig
from sync_runtime.transfer.dtypes import WireDtypes
from sync_runtime.transfer.group import SyncGroup
from sync_runtime.transfer.staging import Staging


def send_source(
    name: str, sources: Mapping[str, torch.Tensor] | None, destination: Staging | None
) -> torch.Tensor | None:
    """The tensor a send reads: the rank's source tensor, else (relay) the destination's live tensor."""
    if sources is not None and name in sources:
        return sources[name]
    if destination is not None and name in destination.tensors:
        return destination.tensors[name]
    return None


def _check_box(
    rank: int,
    side: str,
    t: Transfer,
    name: str,
    box: Box,
    tensor: torch.Tensor | None,
    wire: torch.dtype | None = None,
) -> None:
    """`wire`: the dtype the bytes travel in when it is not `tensor`'s (a destination that casts)."""
    where = f"rank {rank}: {side} tensor {name!r} (canonical {t.tensor!r}) box {list(box)}"

    def mismatch(problem: str) -> PlanMismatchError:
        return PlanMismatchError(f"{where}: {problem}", rank=rank, tensor=t.tensor)

    if tensor is None:
        raise mismatch("this rank holds no tensor of that name")
    shape = tuple(tensor.shape)
    if len(box) != len(shape):
        raise mismatch(f"box has {len(box)} dims, local shape {shape} has {len(shape)}")
    for dim, ((start, stop), size) in enumerate(zip(box, shape, strict=True)):
        if not 0 <= start <= stop <= size:
            raise mismatch(f"dim {dim} range [{start}, {stop}) outside local shape {shape}")
    wire = tensor.dtype if wire is None else wire
    if not cast_defined(_name(wire), _name(tensor.dtype)):
        raise mismatch(f"the wire carries {_name(wire)}, this rank holds {_name(tensor.dtype)}: no cast")
    nbytes = box_numel(box) * wire.itemsize
    if nbytes != t.nbytes:
        raise mismatch(
            f"{box_numel(box)} elements of {wire} are {nbytes} bytes, "
            f"the plan moves {t.nbytes} (dtype disagrees with the manifest)"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def verify_plan_against_tensors(
    plan: RankPlan,
    sources: Mapping[str, torch.Tensor] | None,
    destination: Staging | None,
    wire_dtypes: tuple[tuple[str, str], ...] = (),
) -> None:
    """Raise PlanMismatchError naming rank, tensor, box and shape if any box does not fit.
    `wire_dtypes`: the destination's casts (`TransferConfig.wire_dtypes`)."""
    casts = WireDtypes(wire_dtypes, sources, destination).casts
    for round_sends in plan.sends:
        for bucket in round_sends:
            for t in bucket.transfers:
                src = send_source(t.src_name, sources, destination)
                relayed = sources is None or t.src_name not in sources  # forwarded in the wire dtype
                wire = casts.get(t.tensor) if relayed else None
                _check_box(plan.rank, "source", t, t.src_name, t.src_box, src, wire)
    for round_recvs in plan.recvs:
        for bucket in round_recvs:
            for t in bucket.transfers:
                if destination is None:
                    raise PlanMismatchError(
                        f"rank {plan.rank}: plan has receives (tensor {t.dst_name!r}) "
                        "but no DestinationWeights",
                        rank=plan.rank,
                        tensor=t.tensor,
                    )
                held = destination.tensors.get(t.dst_name)
                _check_box(plan.rank, "destination", t, t.dst_name, t.dst_box, held, casts.get(t.tensor))


def preflight(
    group: SyncGroup,
    plan: RankPlan,
    sources: Mapping[str, torch.Tensor] | None,
    destination: Staging | None,
    config: TransferConfig,
) -> None:
    """Everything a rank can check alone before the first byte moves; raises the typed error."""
    rank = plan.rank
    if config.backend != group.kind:
        raise ConnectError(
            f"rank {rank}: config.backend={config.backend}, group {group.name} is {group.kind}", rank=rank
        )
    if not group.healthy:
        raise ConnectError(f"rank {rank}: group {group.name} saw a failure; close() and reconnect", rank=rank)
    verify_plan_against_tensors(plan, sources, destination, config.wire_dtypes)
    if any(plan.recvs) and (destination is None or not destination.staging_active):
        raise StagingError(f"rank {rank}: destination.begin(version) was not called", rank=rank)
