"""The MTP part (DeepSeek-V3's num_nextn_predict_layers layers): in the manifest as the published
checkpoint names it, planned only to destinations that serve MTP, counted apart in the plan."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sync_runtime.cli import main as cli
from sync_runtime.core.layouts import get_layout
from sync_runtime.core.manifest import MODEL_PART, MTP_PART
from sync_runtime.core.models import load_model_config
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.errors import PlanError
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit

TINY = build_manifest(load_model_config("tiny-deepseek-v3"))  # 3 layers + MTP layer 3

# DeepSeek-V3's published checkpoint (the same architecture's DeepSeek-R1 tensor table, 163 files):
# 91,991 tensors, 684,531,386,000 elements, of which 45,808 are FP8 `weight_scale_inv` tensors
# (dense MLP 3 layers x 3, MLA 62 layers x 5, experts 59 x 256 x 3, shared experts 59 x 3) with
# 41,540,496 elements; layer 61 (MTP) adds embed_tokens, enorm, hnorm, eh_proj [7168, 14336],
# shared_head.norm and shared_head.head [129280, 7168] to an MoE decoder layer.
CHECKPOINT_TENSORS, CHECKPOINT_ELEMENTS = 91_991, 684_531_386_000
SCALE_TENSORS, SCALE_ELEMENTS = 45_808, 41_540_496


def test_deepseek_v3_manifest_with_mtp_is_the_published_checkpoint_less_its_scales() -> None:
    m = build_manifest(load_model_config("deepseek-v3"))
    both = (*m.tensors, *m.mtp)
    assert len(both) + SCALE_TENSORS == CHECKPOINT_TENSORS
    assert sum(t.numel for t in both) + SCALE_ELEMENTS == CHECKPOINT_ELEMENTS
    assert {t.part for t in m.tensors} == {MODEL_PART} and {t.part for t in m.mtp} == {MTP_PART}
    assert all(t.name.startswith("model.layers.61.") for t in m.mtp) and len(m.mtp) == 788
    shapes = {t.name.removeprefix("model.layers.61."): t.shape for t in m.mtp}
    assert shapes["eh_proj.weight"] == (7168, 14336)
    assert shapes["embed_tokens.weight"] == shapes["shared_head.head.weight"] == (129280, 7168)
    assert shapes["enorm.weight"] == shapes["hnorm.weight"] == shapes["shared_head.norm.weight"] == (7168,)
    assert shapes["mlp.experts.255.down_proj.weight"] == (7168, 2048)  # an MoE layer
    # bf16, but for the router's F32 e_score_correction_bias (256 elements: 512 bytes more)
    assert m.part_nbytes(MTP_PART) == m.with_mtp().nbytes - m.nbytes == 2 * 13_463_426_304 + 2 * 256


SHARED_BYTES = 2 * 960 * 128 * 2
"""The MTP layer's embed_tokens and shared_head.head (V x H bf16): vLLM's drafter uses the target's."""


def _side(layout: str, text: str, role: Role, mtp: bool = False, node: str = "") -> SideSpec:
    spec = ParallelSpec.parse(text)
    coords = enumerate_ranks(spec, role)
    if node:
        coords = [dataclasses.replace(c, node=c.node + node) for c in coords]
    return SideSpec(layout, spec, tuple(coords), mtp)


def _plan(source: SideSpec, destinations: list[SideSpec]) -> SyncPlan:
    return plan_sync(TINY, source, destinations, PlannerConfig(bucket_bytes=64 * 1024))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    src=st.sampled_from(["tp=1", "tp=2", "tp=2,pp=3"]),
    dsts=st.lists(
        st.tuples(
            st.sampled_from(["vllm", "hf"]),
            st.sampled_from(["tp=1", "tp=2", "tp=2,ep=2", "tp=1,replicas=2", "tp=2,pp=3"]),
            st.booleans(),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_mtp_bytes_are_wire_bytes_only_of_destinations_serving_mtp(src: str, dsts: list) -> None:
    source = _side("hf", src, Role.SOURCE)
    sides = [_side(lay, text, Role.DESTINATION, mtp, f"-{i}") for i, (lay, text, mtp) in enumerate(dsts)]
    plan = _plan(source, sides)
    off = _plan(source, [dataclasses.replace(s, mtp=False) for s in sides])
    stats = plan.stats
    assert stats["lower_bound_bytes"] == stats["wire_bytes"]
    assert off.stats["lower_bound_bytes"] == off.stats["wire_bytes"] and off.stats["mtp_wire_bytes"] == 0
    assert stats["wire_bytes"] == off.stats["wire_bytes"] + stats["mtp_wire_bytes"]
    assert stats["mtp_wire_bytes"] == sum(stats["side_mtp_bytes"])
    for side, mtp_bytes, line in zip(sides, stats["side_mtp_bytes"], stats["parts"], strict=True):
        assert (mtp_bytes > 0) == side.mtp
        assert ("not sent: destination does not serve MTP" in line) != side.mtp
        if side.mtp:  # every rank holds at least its share; whole copies at tp=1
            sent = TINY.part_nbytes(MTP_PART) - (SHARED_BYTES if side.layout == "vllm" else 0)
            assert mtp_bytes >= sent * side.spec.replicas
            if side.spec.tp == 1 and side.spec.pp == 1:
                assert mtp_bytes == sent * side.spec.replicas
    assert len(stats["mtp_not_sent"]) == sum(not s.mtp for s in sides)
    if any(s.mtp for s in sides):
        assert plan.digest != off.digest


def test_vllm_destination_holds_the_drafter_under_its_names_on_the_last_stage() -> None:
    m, spec = TINY.with_mtp(), ParallelSpec.parse("tp=2,pp=3")
    shards = [get_layout("vllm").shard(m, spec, c) for c in enumerate_ranks(spec, Role.DESTINATION)]
    drafter = {t.name: t.shape for t in shards[-1].tensors if t.name.startswith("drafter.")}
    assert drafter["drafter.model.layers.3.eh_proj.weight"] == (128, 256)  # nn.Linear: whole
    assert drafter["drafter.model.layers.3.enorm.weight"] == (128,)
    assert drafter["drafter.model.layers.3.shared_head.norm.weight"] == (128,)
    assert drafter["drafter.model.layers.3.mtp_block.self_attn.fused_qkv_a_proj.weight"] == (48 + 40, 128)
    assert drafter["drafter.model.layers.3.mtp_block.mlp.experts.routed_experts.w13_weight"] == (8, 32, 128)
    # vLLM 0.32's drafter uses the target's embedding and lm_head: no copy, nothing sent to it.
    assert not [n for n in drafter if "embed_tokens" in n or "shared_head.head" in n]
    held = {p.tensor for s in shards for p in s.pieces}
    assert {t.name for t in m.tensors} - held == {
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.shared_head.head.weight",
    }
    assert not any(t.name.startswith("drafter.") for s in shards[:-2] for t in s.tensors)  # first stages
    # The hf layout holds them (vocab rows, as its embedding): 960 / 2 rows per TP rank.
    hf_last = get_layout("hf").shard(m, spec, shards[-1].coord)
    assert {t.name: t.shape for t in hf_last.tensors}["model.layers.3.shared_head.head.weight"] == (480, 128)
    # Without the MTP part the same layout holds no drafter tensor.
    plain = get_layout("vllm").shard(TINY, spec, shards[-1].coord)
    assert not any(t.name.startswith("drafter.") for t in plain.tensors)


def test_megatron_source_sends_mtp_only_when_a_destination_serves_it() -> None:
    # Megatron-Core holds the MTP layers as GPTModel.mtp (layouts/megatron_mtp.py).
    source = _side("megatron", "tp=2", Role.SOURCE)
    assert _plan(source, [_side("vllm", "tp=2", Role.DESTINATION)]).stats["mtp_wire_bytes"] == 0
    served = _plan(source, [_side("vllm", "tp=2", Role.DESTINATION, mtp=True)]).stats
    assert served["mtp_wire_bytes"] == served["side_mtp_bytes"][0] > 0


def test_serving_mtp_of_a_model_without_it_is_refused() -> None:
    llama = build_manifest(load_model_config("tiny-llama"))
    source, dst = _side("hf", "tp=1", Role.SOURCE), _side("vllm", "tp=1", Role.DESTINATION, mtp=True)
    with pytest.raises(PlanError, match="destination 0 serves MTP, but this llama manifest has no MTP part"):
        plan_sync(llama, source, [dst], PlannerConfig())
    assert plan_sync(llama, source, [dataclasses.replace(dst, mtp=False)], PlannerConfig()).stats[
        "parts"
    ] == [f"destination 0 (vllm:tp=1,pp=1): model {llama.nbytes:,} bytes, sent"]


def test_plan_prints_one_parts_line_per_destination(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "tiny-deepseek-v3", "--src", "tp=2", "--src-layout", "hf"]
    args += ["--dst", "tp=2", "--dst", "tp=1", "--dst-mtp", "on", "--dst-mtp", "off", "--json"]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    served, not_served = summary["parts"]
    assert served.startswith("destination 0 (vllm:tp=2,pp=1): model ")
    assert f"; mtp: 1 layer (model.layers.3.*), {summary['side_mtp_bytes'][0]:,} bytes, sent (" in served
    assert served.endswith("shared_head.head.weight: the target's own, not sent)")
    assert not_served.endswith(
        "; mtp: 1 layer (model.layers.3.*), 838,080 bytes canonical, not sent: destination does not serve MTP"
    )
    assert summary["mtp_bytes"] == TINY.part_nbytes(MTP_PART) == 838_080
    assert summary["not_synced"] == [not_served.replace(": model 1,305,888 bytes, sent;", ":")]
    # Megatron (the default source) holds the MTP layers too (layouts/megatron_mtp.py).
    args = ["plan", "--model", "tiny-deepseek-v3", "--src", "tp=2", "--dst", "tp=2", "--dst-mtp", "on"]
    assert cli.main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["side_mtp_bytes"][0] > 0
    assert (
        cli.main(
            ["plan", "--model", "tiny-deepseek-v3", "--src", "tp=2", "--dst", "tp=2"]
            + ["--dst-mtp", "on"] * 2
        )
        == 2
    )
    assert "2 --dst-mtp for 1 --dst" in capsys.readouterr().err
