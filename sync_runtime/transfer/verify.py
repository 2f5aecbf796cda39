"""Check a rank's plan against the tensors it really holds, and its group and staging, before the
first byte moves."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sync_runtime.core.layouts.base import Box, box_numel
from sync_runtime.core.plan import RankPlan, Transfer
from sync_runtime.errors import ConnectError, PlanMismatchError, StagingError
from sync_runtime.transfer.config import TransferConfig
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


def _check_box(rank: int, side: str, t: Transfer, name: str, box: Box, tensor: torch.Tensor | None) -> None:
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
    nbytes = box_numel(box) * tensor.element_size()
    if nbytes != t.nbytes:
        raise mismatch(
            f"{box_numel(box)} elements of {tensor.dtype} are {nbytes} bytes, "
            f"the plan moves {t.nbytes} (dtype disagrees with the manifest)"
        )


def verify_plan_against_tensors(
    plan: RankPlan,
    sources: Mapping[str, torch.Tensor] | None,
    destination: Staging | None,
) -> None:
    """Raise PlanMismatchError naming rank, tensor, box and shape if any box does not fit."""
    for round_sends in plan.sends:
        for bucket in round_sends:
            for t in bucket.transfers:
                src = send_source(t.src_name, sources, destination)
                _check_box(plan.rank, "source", t, t.src_name, t.src_box, src)
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
                _check_box(
                    plan.rank, "destination", t, t.dst_name, t.dst_box, destination.tensors.get(t.dst_name)
                )


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
    verify_plan_against_tensors(plan, sources, destination)
    if any(plan.recvs) and (destination is None or not destination.staging_active):
        raise StagingError(f"rank {rank}: destination.begin(version) was not called", rank=rank)
