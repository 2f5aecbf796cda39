"""A real Megatron-Core 0.19.2 DeepSeek-V3-like model with MTP layers as a sync's source (tests).

Rank functions for `testing.local_ranks.LocalWorld`: global ranks 0..n_src-1 are Megatron trainer
ranks (their own gloo default group: Megatron's world, local spec, CPU), the next ones an `hf`
destination that serves MTP. Sources build the model with `mtp_num_layers` = the checkpoint's
num_nextn_predict_layers (GPTModel.mtp, seeded init, 1-D weights randomised so a norm mix-up
would show), register it through the real adapter (`engines.megatron.MegatronSource`), export
their shards for the reference (`engines.megatron_convert`, independent of the layout) and send;
destinations return what they committed. Every rank plans the same sync itself (a pure function).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.base import LocalTensorMeta
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import model_dims
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.engines import megatron_cpu
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import dtype_name
from sync_runtime.testing.gloo_world import join_gloo_world
from sync_runtime.testing.local_ranks import RankContext
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan

SEED = 11


def sides(src: str, dst: str) -> tuple[SideSpec, SideSpec]:
    """The megatron source and the hf destination serving MTP (on another node)."""
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    dst_coords = [dataclasses.replace(c, node=c.node + "-dst") for c in enumerate_ranks(d, Role.DESTINATION)]
    return (
        SideSpec("megatron", s, tuple(enumerate_ranks(s, Role.SOURCE))),
        SideSpec("hf", d, tuple(dst_coords), mtp=True),
    )


def plan(config: Mapping[str, Any], src: str, dst: str) -> SyncPlan:
    source, destination = sides(src, dst)
    return plan_sync(
        build_manifest(dict(config)), source, [destination], PlannerConfig(bucket_bytes=64 * 1024)
    )


def build_model(config: Mapping[str, Any], spec: ParallelSpec) -> torch.nn.Module:
    """This rank's GPTModel (vpp=1; GPTModel.mtp on the last stage), local spec, fp32, seeded;
    1-D weights randomised (a norm mix-up would show)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from sync_runtime.testing.megatron_models import init_parallel, layer_spec, megatron_config, padded_vocab

    init_parallel(spec, SEED)
    stage, last = ps.get_pipeline_model_parallel_rank(), spec.pp - 1
    n = int(config["num_nextn_predict_layers"])
    tconfig = dataclasses.replace(megatron_config(config, spec), mtp_num_layers=n)
    block = layer_spec(model_dims(dict(config)), tconfig, None)  # MLA: a decoder block spec
    # pp > 1: the MTP stage's embedding copy is all-reduced from the first stage after `.cuda()`.
    with megatron_cpu.tensor_cuda_noop(spec.pp > 1):
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=block,
            vocab_size=padded_vocab(config, spec.tp),
            max_sequence_length=64,
            pre_process=stage == 0,
            post_process=stage == last,
            share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
            position_embedding_type="rope",
            mtp_block_spec=get_gpt_mtp_block_spec(tconfig, block, use_transformer_engine=False),
        )
    g = torch.Generator().manual_seed(SEED)  # the same values on every rank: one generator, one order
    with torch.no_grad():
        for _, t in (*model.named_parameters(), *model.named_buffers()):
            if t.dim() == 1 and t.is_floating_point():
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g))
    return model


def mtp_rank(
    ctx: RankContext, config: dict[str, Any], src: str, dst: str, rendezvous: str, scramble: str | None
) -> dict[str, Any]:
    """One rank of the sync. Sources: `scramble` names a local tensor reversed (rows) after the
    export, so the reference keeps the trainer's weights. Returns what the test checks (a
    source: its reported tensors, as discovery gets them)."""
    from sync_runtime.engines.megatron import MegatronSource
    from sync_runtime.engines.megatron_convert import export_shards

    source_side, destination_side = sides(src, dst)
    n_src = len(source_side.coords)
    sync_plan = plan(config, src, dst)
    planned = build_manifest(config).with_mtp()
    out: dict[str, Any] = {"role": "source" if ctx.rank < n_src else "destination"}
    sources = destination = None
    if ctx.rank < n_src:
        megatron_cpu.install()
        if not dist.is_initialized():  # Megatron's world: the source ranks only
            join_gloo_world(rendezvous, ctx.rank, n_src)
        spec = source_side.spec
        source = MegatronSource([build_model(config, spec)], config, layer_counts=spec.layer_counts)
        _same(source.manifest.with_mtp(), planned)
        want = source_side.coords[ctx.rank]
        assert (source.coord.tp_rank, source.coord.pp_rank) == (want.tp_rank, want.pp_rank), source.coord
        out.update(layout=source.layout, exports=export_shards(source.live), coord=source.coord)
        out["tensors"] = [
            LocalTensorMeta(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in source.tensors.items()
        ]
        out["model_config"] = source.model_config
        sources = source.tensors
        if scramble in sources:  # on every rank holding it
            with torch.no_grad():
                sources[scramble].copy_(sources[scramble].flip(0))
    else:
        coord = destination_side.coords[ctx.rank - n_src]
        shard = get_layout("hf").shard(planned, destination_side.spec, coord)
        zeros = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in shard.tensors}
        destination = DestinationWeights(zeros, version="v0")
        destination.begin("v1")
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=ctx.world_size,
        backend="gloo", timeout_s=60.0, group_name=ctx.group_name,
    )  # fmt: skip
    try:
        result = run_rank_plan(
            group, sync_plan.for_rank(ctx.rank), sources=sources, destination=destination,
            config=TransferConfig(timeout_s=60.0),
        )  # fmt: skip
    finally:
        group.close()
    out.update(ok=result.ok, failure=result.failure)
    if destination is not None and result.ok:
        out["version"] = destination.commit()
        out["tensors"] = {n: t.clone() for n, t in destination.tensors.items()}
    return out


def _same(reported: Manifest, planned: Manifest) -> None:
    """The manifest the trainer reports (names, shapes, dtypes) is the one every rank planned."""
    got = [(t.name, t.shape, t.dtype, t.part) for t in reported.tensors]
    want = [(t.name, t.shape, t.dtype, t.part) for t in planned.tensors]
    if got != want:
        raise AssertionError(f"reported manifest differs: {sorted(set(got) ^ set(want))[:4]}")
