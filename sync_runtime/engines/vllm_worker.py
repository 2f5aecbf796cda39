"""A vLLM worker as a WeightSync destination rank: `worker_extension_cls` for vllm.LLM.

vLLM mixes `VllmWorkerExtension` into every worker (`worker_extension_cls=
"sync_runtime.engines.vllm_worker.VllmWorkerExtension"`). Inside each worker it holds an
ordinary `WeightSyncParticipant` (role destination, coordinates from vLLM's own parallel state)
whose staging is `VllmStaging`: host buffers in the per-rank shapes of vLLM's pre-load metadata,
applied at commit through vLLM's loaders and post-processing (vllm_apply.py). The coordinator's
`ws_*` protocol is therefore exactly the one every other participant speaks; the replica actor
(vllm_replica.py) only forwards each call through `llm.collective_rpc("ws_dispatch", ...)`, and
the shards themselves travel over the sync's own process group, never through vLLM's RPC.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.engines.vllm_apply import (
    ApplyReport,
    EngineTensor,
    apply_shards,
    check_expert_placement,
    check_staged,
    engine_tensors,
    kernel_state,
    mtp_drafter,
    require_supported_vllm,
)
from sync_runtime.engines.vllm_delta import CommittedBase, widened
from sync_runtime.engines.vllm_drafter import WithDrafter, apply_with_drafter, drafter_tensors
from sync_runtime.errors import DestinationError, ParticipantError, StagingError, SyncStep, WeightSyncError
from sync_runtime.runtime.participant import ParticipantMeta, WeightSyncParticipant
from sync_runtime.transfer import RankResult, TransferConfig, spans
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from sync_runtime.transfer.staging import StagingProgress, combine_hex

log = logging.getLogger("weightsync.vllm")

Applier = Callable[[Mapping[str, torch.Tensor]], ApplyReport]


class VllmStaging(StagingProgress):
    """`transfer.staging.Staging` for a vLLM rank: host staging, applied by vLLM at commit.

    `tensors` are meta tensors (shape and wire dtype only, no memory): the live weights are in
    vLLM's kernel layouts (CPU linears repacked to shape [0], MoE experts prepacked) and are never
    read or written by the transfer. `staged` hands out host buffers, one per tensor, in the
    dtype of the parameter each lands in (`live_dtype`: an fp32 `e_score_correction_bias` is
    staged in fp32, so an fp32 source's bytes arrive exactly and a bf16 one's are widened once, on
    receipt); `commit` validates them all, then applies them in one pass; `abort` drops them and
    leaves the engine as it was. `checksums` are those of the bytes last committed, in the staged
    (live) dtype: what the rank holds. With `keep_base` a commit keeps its staged buffers as the
    base of the next sync's deltas (`delta_base`, vllm_delta.py); without, it keeps them as the
    next sync's staging (`_spare`): a fresh host buffer is page-faulted in as it is first
    written, which cost a full sync about as much as one more copy of the shard. Only buffers
    of a commit are reused (every receive into them completed), never those of an aborted sync,
    which a failed transfer may still write.
    """

    def __init__(
        self, expected: Mapping[str, EngineTensor], apply: Applier, version: str = "", *, pinned: bool = False
    ) -> None:
        self.version = version
        self.pinned = pinned
        """Staging in page-locked host memory (a CUDA worker's): the landing's device -> host copies
        and the apply's host -> device copies then run at DMA speed. Buffers are kept between
        syncs (`_spare`), so the slow page-locked allocation happens once per shard."""
        self.poisoned = False
        self.last_apply: ApplyReport | None = None
        self._expected = dict(expected)
        self._meta = {
            n: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta") for n, t in expected.items()
        }
        self._staging_dtype = {n: getattr(torch, t.live_dtype) for n, t in expected.items()}
        self._apply = apply
        self._committed_sums: dict[str, str] = {}
        self._staged: dict[str, torch.Tensor] | None = None
        self._staged_sums: dict[str, str] | None = None
        """Per tensor, the checksums `staged_checksum` last read; None once a buffer was handed
        out since (it may have been written)."""
        self._pending_version: str | None = None
        self._lock = threading.Lock()
        self.keep_base = False
        """Set per sync from TransferConfig.keep_sent (delta auto on gloo)."""
        self._base = CommittedBase()
        self._spare: dict[str, torch.Tensor] = {}
        self._widened = widened(self._meta, self._staging_dtype)

    @property
    def delta_base(self) -> MappingProxyType[str, torch.Tensor]:
        """The bytes of the committed version a delta rebuilds from (transfer/delta_wire.py)."""
        return self._base.tensors

    @property
    def holds_base(self) -> bool:
        """This rank can take deltas against its committed version (`ParticipantMeta.live_base`)."""
        return not self._widened and not self.poisoned and self._base.holds(self.version)

    @property
    def tensors(self) -> MappingProxyType[str, torch.Tensor]:
        return MappingProxyType(self._meta)

    @property
    def staging_dtypes(self) -> MappingProxyType[str, torch.dtype]:
        return MappingProxyType(self._staging_dtype)

    def checksums(self) -> dict[str, str]:
        return dict(self._committed_sums)

    def set_policy(self, policy: str) -> None:
        """Only host staging: the device holds vLLM's processed weights, never a second copy."""
        if policy != "host":
            raise StagingError(f"staging {policy!r}: a vLLM destination stages in host memory only")

    def begin(self, version: str) -> None:
        with self._lock:
            if not self.keep_base:
                self._base.drop()  # delta off (or NCCL): the copy is freed before staging grows
            self._staged, self._staged_sums = {}, None
            self._pending_version = version

    def staged(self, name: str, *, fully_written: bool = False) -> torch.Tensor:
        with self._lock:
            if self._staged is None:
                raise StagingError("begin(version) was not called before receiving into staging")
            self._staged_sums = None  # the caller may write into it
            buf = self._staged.get(name)
            if buf is None:
                meta = self._meta.get(name)
                if meta is None:
                    raise StagingError(f"the engine holds no tensor {name!r}", tensor=name)
                buf = self._spare.pop(name, None)
                if buf is None:
                    make = torch.empty if fully_written else torch.zeros  # zeros: vocab padding rows
                    buf = make(
                        meta.shape, dtype=self._staging_dtype[name], device="cpu", pin_memory=self.pinned
                    )
                elif not fully_written:
                    buf.zero_()  # the previous version's bytes must not show where nothing lands
                self._staged[name] = buf
            return buf

    def staged_checksum(self) -> str:
        with self._lock:
            if self._staged is None:
                raise StagingError("staged_checksum() without begin(version)")
            with spans.span("stage.checksum_all"):
                self._staged_sums = _sums(self._staged)
            return combine_hex(self._staged_sums)

    def commit(self, version: str | None = None) -> str:
        with self._lock:
            if self._staged is None or self._pending_version is None:
                raise StagingError("commit() without begin(version)", step=SyncStep.COMMIT)
            if version is not None and version != self._pending_version:
                raise StagingError(
                    f"commit({version!r}) but staging holds {self._pending_version!r}", step=SyncStep.COMMIT
                )
            check_staged(self._staged, self._expected)  # before the model is touched
            # The two-phase commit re-read every staged byte just before this (staged_checksum, to
            # refuse bytes changed after the decision), and no buffer was handed out since: those
            # are the committed checksums, no third pass over the staging inside the pause.
            sums = self._staged_sums
            if sums is None:
                with spans.span("commit.checksum_per_tensor"):
                    sums = _sums(self._staged)
            try:
                with spans.span("commit.apply"):
                    self.last_apply = self._apply(self._staged)
            except Exception:
                # The model is half re-materialised: it serves neither version now.
                self.poisoned = True
                self._base.drop()
                raise
            self.version, self.poisoned = self._pending_version, False
            self._committed_sums = sums
            if self.keep_base:  # the apply only read them: they are the committed bytes
                self._base.keep(self._staged, self.version)
                self._spare = {}  # a spare and a base never coexist: staging never aliases the base
            else:
                self._base.drop()
                self._spare = self._staged  # the apply copied them into the model: free to reuse
            self._staged, self._staged_sums, self._pending_version = None, None, None
            return self.version

    def abort(self) -> None:
        with self._lock:
            self._staged, self._staged_sums, self._pending_version = None, None, None


def _sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {n: hex_digest(checksum_tensor(t)) for n, t in sorted(tensors.items())}


class VllmRankParticipant(WeightSyncParticipant):
    """The participant inside a vLLM worker. It lives outside Ray (a process vLLM spawned), so
    the Ray identity it reports is its replica actor's, handed over at setup."""

    actor_name = ""
    actor_id = ""
    model: torch.nn.Module | None = None

    def ws_meta(self) -> ParticipantMeta:
        st = self._ws_state()
        from sync_runtime.core.layouts.base import LocalTensorMeta

        metas = tuple(
            LocalTensorMeta(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for n, t in self._ws_live().items()
        )
        return ParticipantMeta(
            role=st.role,
            coord=st.coord,
            layout=st.layout,
            tensors=metas,
            node_ip=st.coord.node,
            device=st.coord.device,
            pid=os.getpid(),
            actor_name=self.actor_name,
            actor_id=self.actor_id,
            version=self.ws_version(),
            group_name=st.group_key[0] if st.group_key else None,
            group_healthy=st.group is not None and bool(st.group.healthy),
            model_config=None,
            live_base=isinstance(st.destination, VllmStaging) and st.destination.holds_base,
        )

    def ws_run(
        self, plan: Any, digest: str, version: str, config: TransferConfig, txn: str | None = None
    ) -> RankResult:
        """The participant's run; the staging keeps its commit as the next delta base only
        while the syncs may send deltas (delta auto, gloo)."""
        staging = self._ws_state().destination
        if isinstance(staging, VllmStaging):
            staging.keep_base = config.keep_sent
        return super().ws_run(plan, digest, version, config, txn)

    def ws_kernel_checksums(self) -> dict[str, str]:
        """Checksums of everything the kernels read (`kernel_state`): after a sync they must equal
        those of an engine that loaded the same weights from a checkpoint, derived tensors too."""
        if self.model is None:
            raise ParticipantError("ws_kernel_checksums before ws_setup")
        return {n: hex_digest(checksum_tensor(t)) for n, t in kernel_state(self.model).items()}

    def ws_spans(self) -> dict[str, dict[str, float]]:
        """This worker process's phase tallies since the last call (transfer/spans.py)."""
        return spans.take()

    def ws_staging_dtypes(self) -> dict[str, str]:
        """Per tensor, the dtype it is staged and committed in (`ws_checksums` are of that)."""
        staging = self._ws_state().destination
        assert isinstance(staging, VllmStaging)
        return {n: str(d).removeprefix("torch.") for n, d in staging.staging_dtypes.items()}

    def ws_sha256(self) -> dict[str, str]:
        raise ParticipantError("a vLLM rank holds its weights in kernel layouts: compare ws_checksums")

    def ws_tensor(self, name: str) -> torch.Tensor:
        raise ParticipantError(f"{name}: a vLLM rank holds its weights in kernel layouts, not readable")


def _worker_coord(worker: Any, replica: int, node: str) -> tuple[RankCoord, int]:
    """(coordinates, local index in the server) from vLLM's own parallel state.

    A data-parallel server (`--data-parallel-size D`) runs D engines whose workers all take
    part in each weight-transfer call; their local indices follow those of the lower DP ranks
    (tp*pp each). Each DP engine of a dense model (or of a MoE model without expert parallel)
    holds a whole model copy, so it is its own replica: `replica` (the server's first) + its DP
    rank. With expert parallel (vLLM's wide EP) the experts are split over all DP engines' ranks:
    the server is one replica, each worker at its `dp_rank`, its `ep_rank` vLLM's EP group rank
    (dp_rank * tp + tp_rank: topology.destination_ep_rank)."""
    from vllm.distributed import parallel_state as ps

    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    parallel = worker.vllm_config.parallel_config
    # A dense model's DP engines are made independent (vLLM sets their DP size to 1 and keeps the
    # DP rank as `data_parallel_index`, 0.32; a MoE model's keep `data_parallel_rank`).
    dp_rank = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))
    wide = is_wide_ep(worker.vllm_config)
    ep_rank = 0
    if parallel.enable_expert_parallel:
        ep_rank = ps.get_ep_group().rank_in_group
    coord = RankCoord(
        role=Role.DESTINATION,
        replica=replica if wide else replica + dp_rank,
        tp_rank=tp.rank_in_group,
        pp_rank=pp.rank_in_group,
        dp_rank=dp_rank if wide else 0,
        ep_rank=ep_rank,
        node=node,
        device=str(worker.device),
    )
    per_engine = tp.world_size * pp.world_size
    return coord, dp_rank * per_engine + pp.rank_in_group * tp.world_size + tp.rank_in_group


def is_wide_ep(vllm_config: Any) -> bool:
    """Expert parallel across data-parallel engines (vLLM's wide EP): the engines together are
    one replica. A dense model's DP engines keep DP size 1 inside (see `_worker_coord`)."""
    parallel = vllm_config.parallel_config
    return bool(parallel.enable_expert_parallel) and int(parallel.data_parallel_size) > 1


def check_wide_ep(vllm_config: Any) -> None:
    """Wide EP is synced without pipeline stages only (the layout's and topology's rule)."""
    parallel = vllm_config.parallel_config
    if is_wide_ep(vllm_config) and parallel.pipeline_parallel_size > 1:
        raise DestinationError(
            f"expert parallel across {parallel.data_parallel_size} data-parallel ranks (vLLM's wide EP) "
            f"with {parallel.pipeline_parallel_size} pipeline stages is not supported by the weightsync "
            "backend (wide EP: pipeline parallel size 1)"
        )


Result = tuple[str, Any]
"""("ok", value) | ("error", exception) | ("skip", None): what one worker answers a dispatch."""


class VllmWorkerExtension:
    """Mixed into vLLM's worker class; its methods run inside every worker process."""

    participant_class: type[VllmRankParticipant] = VllmRankParticipant
    """Tests substitute a subclass (fault injection)."""

    _ws_part: VllmRankParticipant | None = None
    _ws_index: int = -1

    def ws_dispatch(self, method: str, payload: bytes) -> bytes:
        """Run `method(*args[my local index])` on this worker's participant.

        `payload` is the pickled {local_index: args}; the answer is a pickled `Result`. vLLM's
        RPC encodes with msgspec, which would turn dataclasses (RankPlan, ParticipantMeta,
        RankResult) into dicts, so control data crosses it as pickled bytes (never tensors).
        Never raises: collective_rpc would drop every other worker's answer, so a failure
        travels back as this rank's own result and the actor re-raises it for this rank only.
        """
        return pickle.dumps(self._ws_dispatch(method, pickle.loads(payload)))

    def _ws_dispatch(self, method: str, per_rank: Mapping[int, tuple]) -> Result:
        try:
            if method == "ws_setup":
                return "ok", self._ws_setup(*per_rank[self._ws_local_index()])
            index = self._ws_local_index()
            if index not in per_rank:
                return "skip", None
            part = self._ws_part
            if part is None:
                raise ParticipantError("ws_setup was never called on this vLLM worker")
            if not method.startswith("ws_") or not callable(getattr(part, method, None)):
                raise ParticipantError(f"{method!r} is not a participant method")
            return "ok", getattr(part, method)(*per_rank[index])
        except Exception as e:  # typed errors pass as they are; the rest become one line
            if not isinstance(e, WeightSyncError):
                log.exception("vLLM worker: %s failed", method)
                e = DestinationError(f"{method}: {type(e).__name__}: {e}")
            return "error", e

    def _ws_local_index(self) -> int:
        if self._ws_index < 0:
            _, self._ws_index = _worker_coord(self, 0, "")
        return self._ws_index

    def _ws_setup(self, replica: int, node: str, actor_name: str, actor_id: str) -> ParticipantMeta:
        """Become a destination rank: tensors and coordinates read from the live engine (its
        MTP drafter's too, where it has one: vllm_drafter.py)."""
        require_supported_vllm()
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        check_wide_ep(vllm_config)
        check_expert_placement(vllm_config)
        model = self.model_runner.model  # type: ignore[attr-defined]
        coord, self._ws_index = _worker_coord(self, replica, node)
        dtype = vllm_config.model_config.dtype
        expected = engine_tensors(model, dtype)
        apply: Applier = lambda staged: apply_shards(model, vllm_config, staged)  # noqa: E731
        drafter = mtp_drafter(self.model_runner, vllm_config)  # type: ignore[attr-defined]
        if drafter is not None:
            expected |= drafter_tensors(drafter, model, dtype)
            apply = lambda staged: apply_with_drafter(model, drafter, vllm_config, staged)  # noqa: E731
        # A CUDA worker stages in page-locked memory (its copies to and from the device are DMA)
        device = torch.device(self.device)  # type: ignore[attr-defined]
        staging = VllmStaging(expected, apply, pinned=device.type == "cuda")
        part = self.participant_class()
        part.actor_name, part.actor_id = actor_name, actor_id
        part.model = model if drafter is None else WithDrafter(model, drafter)  # what kernels read
        part.ws_init(role=Role.DESTINATION, coord=coord, layout="vllm", tensors={}, destination=staging)
        self._ws_part = part
        return part.ws_meta()
