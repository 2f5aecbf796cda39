"""MoE (qwen3_moe) and MLA (deepseek_v3) layouts: golden shards from design §4, round trips, errors, speed."""

from __future__ import annotations

import numpy as np
import pytest

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.layouts.megatron import MegatronLayout
from sync_runtime.core.layouts.vllm import VllmLayout
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import LayoutError
from sync_runtime.runtime.hf_manifest import build_manifest
from tests.test_layouts import assert_round_trip, canon_of

pytestmark = pytest.mark.unit

SRC, DST = Role.SOURCE, Role.DESTINATION
L0, M0 = "model.layers.0.", "decoder.layers.0."
E = 8  # routed experts in both tiny MoE presets


def model(preset: str, **overrides: object) -> Manifest:
    return build_manifest({**load_model_config(preset), **overrides})


def local(layout: str, m: Manifest, spec: ParallelSpec, canon, **coord: int) -> dict[str, np.ndarray]:
    role = SRC if layout.startswith("megatron") else DST
    return materialize(get_layout(layout).shard(m, spec, RankCoord(role=role, **coord)), canon)


def expert(c, layer: int, e: int, proj: str) -> np.ndarray:
    return c[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"]


# ---------------------------------------------------------------- vllm experts


def test_vllm_w13_w2_without_ep() -> None:
    m = model("tiny-qwen3-moe")  # H=64, Im=32; t=2 -> 16 rows of gate and of up per expert
    c = canon_of(m)
    for r in range(2):
        got = local("vllm", m, ParallelSpec(tp=2), c, tp_rank=r)
        w13, w2 = (
            got[L0 + "mlp.experts.routed_experts.w13_weight"],
            got[L0 + "mlp.experts.routed_experts.w2_weight"],
        )
        assert w13.shape == (E, 32, 64) and w2.shape == (E, 64, 16)
        rows = slice(r * 16, (r + 1) * 16)
        for e in range(E):
            want = np.concatenate([expert(c, 0, e, "gate")[rows], expert(c, 0, e, "up")[rows]])
            np.testing.assert_array_equal(w13[e], want)
            np.testing.assert_array_equal(w2[e], expert(c, 0, e, "down")[:, rows])
        np.testing.assert_array_equal(got[L0 + "mlp.gate.weight"], c[L0 + "mlp.gate.weight"])


def test_vllm_w13_w2_with_ep() -> None:
    m = model("tiny-qwen3-moe")
    c = canon_of(m)
    spec = ParallelSpec(tp=4, ep=4)
    for r in range(4):
        got = local("vllm", m, spec, c, tp_rank=r, ep_rank=r)
        w13, w2 = (
            got["model.layers.2.mlp.experts.routed_experts.w13_weight"],
            got["model.layers.2.mlp.experts.routed_experts.w2_weight"],
        )
        assert w13.shape == (2, 64, 64) and w2.shape == (2, 64, 32)
        for k in range(2):
            e = 2 * r + k
            np.testing.assert_array_equal(
                w13[k], np.concatenate([expert(c, 2, e, "gate"), expert(c, 2, e, "up")])
            )
            np.testing.assert_array_equal(w2[k], expert(c, 2, e, "down"))


def test_vllm_dense_layer_of_moe_model() -> None:
    m = model("tiny-qwen3-moe")  # mlp_only_layers=[1]
    got = local("vllm", m, ParallelSpec(tp=2), canon_of(m), tp_rank=0)
    assert "model.layers.1.mlp.gate_up_proj.weight" in got
    assert (
        "model.layers.1.mlp.experts.routed_experts.w13_weight" not in got
        and "model.layers.1.mlp.gate.weight" not in got
    )


# ---------------------------------------------------------------- megatron experts


def test_megatron_experts_ep() -> None:
    m = model("tiny-qwen3-moe")
    c = canon_of(m)
    spec = ParallelSpec(tp=2, dp=2, ep=4)
    for coord in enumerate_ranks(spec, SRC):
        got = materialize(MegatronLayout().shard(m, spec, coord), c)
        for k in range(2):
            e = coord.ep_rank * 2 + k
            fc1 = np.concatenate([expert(c, 0, e, "gate"), expert(c, 0, e, "up")])
            # Local spec (SequentialMLP): one module per local expert k.
            np.testing.assert_array_equal(got[f"{M0}mlp.experts.local_experts.{k}.linear_fc1.weight"], fc1)
            np.testing.assert_array_equal(
                got[f"{M0}mlp.experts.local_experts.{k}.linear_fc2.weight"], expert(c, 0, e, "down")
            )
            # TE spec (TEGroupedMLP): one grouped module, weight{k} per local expert.
            te = materialize(get_layout("megatron-te").shard(m, spec, coord), c)
            np.testing.assert_array_equal(te[f"{M0}mlp.experts.linear_fc1.weight{k}"], fc1)
            np.testing.assert_array_equal(
                te[f"{M0}mlp.experts.linear_fc2.weight{k}"], expert(c, 0, e, "down")
            )
        assert f"{M0}mlp.experts.local_experts.2.linear_fc1.weight" not in got
        np.testing.assert_array_equal(got[M0 + "mlp.router.weight"], c[L0 + "mlp.gate.weight"])
        np.testing.assert_array_equal(
            got[M0 + "pre_mlp_layernorm.weight"], c[L0 + "post_attention_layernorm.weight"]
        )
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in got  # the dense layer (local spec)
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te  # the dense layer (TE)


def test_megatron_experts_etp_uses_reported_coords() -> None:
    m = model("tiny-qwen3-moe")  # Im=32: etp=2 -> 16 rows each of gate/up, 16 columns of down
    c = canon_of(m)
    spec = ParallelSpec(tp=2, dp=2, ep=2, etp=2)
    # Coordinates as a participant reports them, deliberately not derived from tp/dp ranks.
    got = local("megatron", m, spec, c, tp_rank=0, dp_rank=0, ep_rank=1, etp_rank=1)
    rows = slice(16, 32)
    for k in range(4):
        e = 4 + k
        fc1 = np.concatenate([expert(c, 2, e, "gate")[rows], expert(c, 2, e, "up")[rows]])
        x = f"decoder.layers.2.mlp.experts.local_experts.{k}."
        np.testing.assert_array_equal(got[x + "linear_fc1.weight"], fc1)
        np.testing.assert_array_equal(got[x + "linear_fc2.weight"], expert(c, 2, e, "down")[:, rows])


# ---------------------------------------------------------------- MLA (deepseek_v3)

A = "model.layers.1.self_attn."


def test_vllm_mla() -> None:
    m = model("tiny-deepseek-v3")  # nh=4: t=2 -> 2 heads; qk head 24, kv_b head 32, v head 16
    c = canon_of(m)
    for r in range(2):
        got = local("vllm", m, ParallelSpec(tp=2), c, tp_rank=r)
        np.testing.assert_array_equal(
            got[A + "fused_qkv_a_proj.weight"],
            np.concatenate([c[A + "q_a_proj.weight"], c[A + "kv_a_proj_with_mqa.weight"]]),
        )
        assert A + "q_a_proj.weight" not in got and A + "kv_a_proj_with_mqa.weight" not in got
        np.testing.assert_array_equal(
            got[A + "q_b_proj.weight"], c[A + "q_b_proj.weight"][r * 48 : (r + 1) * 48]
        )
        np.testing.assert_array_equal(
            got[A + "kv_b_proj.weight"], c[A + "kv_b_proj.weight"][r * 64 : (r + 1) * 64]
        )
        np.testing.assert_array_equal(
            got[A + "o_proj.weight"], c[A + "o_proj.weight"][:, r * 32 : (r + 1) * 32]
        )
        for norm in ("q_a_layernorm.weight", "kv_a_layernorm.weight"):
            np.testing.assert_array_equal(got[A + norm], c[A + norm])
        s = "model.layers.1.mlp.shared_experts."
        rows = slice(r * 16, (r + 1) * 16)
        np.testing.assert_array_equal(
            got[s + "gate_up_proj.weight"],
            np.concatenate([c[s + "gate_proj.weight"][rows], c[s + "up_proj.weight"][rows]]),
        )
        np.testing.assert_array_equal(got[s + "down_proj.weight"], c[s + "down_proj.weight"][:, rows])
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        np.testing.assert_array_equal(got[bias], c[bias])
        assert "model.layers.0.mlp.gate_up_proj.weight" in got  # first_k_dense_replace=1


def test_megatron_mla() -> None:
    m = model("tiny-deepseek-v3")
    c = canon_of(m)
    got = local("megatron", m, ParallelSpec(tp=2, ep=2), c, tp_rank=1, ep_rank=1)
    te = local("megatron-te", m, ParallelSpec(tp=2, ep=2), c, tp_rank=1, ep_rank=1)
    a, d = A, "decoder.layers.1.self_attention."
    shared = {
        "linear_q_up_proj.weight": c[a + "q_b_proj.weight"][48:96],
        "linear_kv_up_proj.weight": c[a + "kv_b_proj.weight"][64:128],
        "linear_proj.weight": c[a + "o_proj.weight"][:, 32:64],
    }
    # Local spec: the down-projections are ColumnParallelLinear (q_lora=48 -> rows 24:48;
    # kv_lora+rope=40 -> rows 20:40, across the [kv_lora; rope] boundary); norms are modules.
    pairs = {
        **shared,
        "linear_q_down_proj.weight": c[a + "q_a_proj.weight"][24:48],
        "q_layernorm.weight": c[a + "q_a_layernorm.weight"],
        "linear_kv_down_proj.weight": c[a + "kv_a_proj_with_mqa.weight"][20:40],
        "kv_layernorm.weight": c[a + "kv_a_layernorm.weight"],
    }
    # TE spec: duplicated down-projections, norms fused into the up-projections.
    te_pairs = {
        **shared,
        "linear_q_down_proj.weight": c[a + "q_a_proj.weight"],
        "linear_q_up_proj.layer_norm_weight": c[a + "q_a_layernorm.weight"],
        "linear_kv_down_proj.weight": c[a + "kv_a_proj_with_mqa.weight"],
        "linear_kv_up_proj.layer_norm_weight": c[a + "kv_a_layernorm.weight"],
    }
    for held, want_all in ((got, pairs), (te, te_pairs)):
        for name, want in want_all.items():
            np.testing.assert_array_equal(held[d + name], want, err_msg=name)
    np.testing.assert_array_equal(
        got["decoder.layers.1.input_layernorm.weight"], c["model.layers.1.input_layernorm.weight"]
    )
    np.testing.assert_array_equal(
        got["decoder.layers.1.mlp.router.expert_bias"], c["model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    s = "model.layers.1.mlp.shared_experts."
    np.testing.assert_array_equal(
        got["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"],
        np.concatenate([c[s + "gate_proj.weight"][16:], c[s + "up_proj.weight"][16:]]),
    )
    np.testing.assert_array_equal(
        got["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"], expert(c, 1, 7, "down")
    )
    np.testing.assert_array_equal(
        te["decoder.layers.1.mlp.experts.linear_fc2.weight3"], expert(c, 1, 7, "down")
    )


def test_mla_without_q_lora() -> None:
    m = model("tiny-deepseek-v3", q_lora_rank=None)
    c = canon_of(m)
    v = local("vllm", m, ParallelSpec(tp=2), c, tp_rank=1)
    np.testing.assert_array_equal(v[A + "q_proj.weight"], c[A + "q_proj.weight"][48:96])
    np.testing.assert_array_equal(v[A + "kv_a_proj_with_mqa.weight"], c[A + "kv_a_proj_with_mqa.weight"])
    assert A + "fused_qkv_a_proj.weight" not in v
    g = local("megatron", m, ParallelSpec(tp=2), c, tp_rank=1)
    d = "decoder.layers.1.self_attention."
    np.testing.assert_array_equal(g[d + "linear_q_proj.weight"], c[A + "q_proj.weight"][48:96])
    np.testing.assert_array_equal(
        g["decoder.layers.1.input_layernorm.weight"], c["model.layers.1.input_layernorm.weight"]
    )
    np.testing.assert_array_equal(
        g[d + "linear_kv_down_proj.weight"], c[A + "kv_a_proj_with_mqa.weight"][20:40]
    )
    te = local("megatron-te", m, ParallelSpec(tp=2), c, tp_rank=1)
    np.testing.assert_array_equal(
        te[d + "linear_q_proj.layer_norm_weight"], c["model.layers.1.input_layernorm.weight"]
    )


# ---------------------------------------------------------------- round trips

GRID = {
    "vllm": ["tp=1", "tp=2", "tp=4", "tp=4,ep=4", "tp=2,pp=3", "tp=2,ep=2,pp=2,replicas=2"],
    "megatron": [
        "tp=1",
        "tp=2,ep=2",
        "tp=2,dp=2,ep=4",
        "tp=2,dp=2,ep=2,etp=2",
        "tp=2,dp=4,ep=8",
    ],
    "megatron-te": ["tp=2,ep=2", "tp=2,dp=2,ep=2,etp=2"],
    "hf": ["tp=1", "tp=2", "tp=4,ep=4", "tp=2,pp=2"],
}


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize(("layout", "spec"), [(lay, s) for lay, specs in GRID.items() for s in specs])
def test_round_trip_moe_mla(layout: str, spec: str, preset: str) -> None:
    assert_round_trip(layout, model(preset), ParallelSpec.parse(spec))


# Megatron splits PP evenly (L % pp == 0): the PP cases are per preset (qwen3-moe L=4, dsv3 L=3).
PP_CASES = [
    ("tiny-qwen3-moe", "tp=2,pp=2,dp=2,ep=4"),
    ("tiny-qwen3-moe", "tp=1,pp=4"),
    ("tiny-deepseek-v3", "tp=1,pp=3"),
    ("tiny-deepseek-v3", "tp=2,pp=3,dp=2,ep=4"),
]


@pytest.mark.parametrize("layout", ["megatron", "megatron-te"])
@pytest.mark.parametrize(("preset", "spec"), PP_CASES)
def test_round_trip_megatron_pp(layout: str, preset: str, spec: str) -> None:
    assert_round_trip(layout, model(preset), ParallelSpec.parse(spec))


def test_round_trip_uneven_pp_explicit_counts() -> None:
    assert_round_trip(
        "megatron", model("tiny-qwen3-moe"), ParallelSpec(tp=2, pp=2, dp=2, ep=4, layer_counts=(3, 1))
    )
    assert_round_trip("vllm", model("tiny-deepseek-v3"), ParallelSpec(tp=2, pp=2, layer_counts=(1, 2)))


def test_round_trip_vpp_moe() -> None:
    assert_round_trip("megatron", model("tiny-qwen3-moe"), ParallelSpec(tp=2, pp=2, vpp=2, dp=2, ep=4))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("layout", "preset", "spec", "pattern"),
    [
        ("vllm", "tiny-qwen3-moe", "tp=2,ep=4", r"vllm: ep: ep=4 must be 1, tp=2 or tp\*dp=2"),
        (
            "vllm",
            "tiny-qwen3-moe",
            "tp=2,dp=2,ep=2",
            r"vllm: dp: dp=2: data parallel inside a replica is wide EP",
        ),
        (
            "vllm",
            "tiny-deepseek-v3",
            "tp=8",
            r"vllm: model\.layers\.0\.self_attn\.q_b_proj\.weight: nh=4 not divisible",
        ),
        (
            "megatron",
            "tiny-qwen3-moe",
            "tp=1,dp=3,ep=3",
            r"megatron: mlp\.experts: E=8 not divisible by ep=3",
        ),
        (
            "megatron",
            "tiny-qwen3-moe",
            "tp=2,dp=2,ep=8",
            r"megatron: ep: ep\*etp=8 does not divide tp\*cp\*dp=4",
        ),
        (
            "megatron",
            "tiny-deepseek-v3",
            "tp=1,dp=2,ep=2,etp=1,pp=4",
            r"megatron: pp: pp=4 has more stages than the model's 3 layers",
        ),
        ("hf", "tiny-qwen3-moe", "tp=3,ep=3", r"hf: mlp\.experts: E=8 not divisible by ep=3"),
        (
            "hf",
            "tiny-qwen3-moe",
            "tp=3",
            r"hf: model\.layers\.0\.self_attn\.q_proj\.weight: nh=8 not divisible by tp=3",
        ),
    ],
)
def test_moe_errors(layout: str, preset: str, spec: str, pattern: str) -> None:
    with pytest.raises(LayoutError, match=pattern):
        get_layout(layout).validate(model(preset), ParallelSpec.parse(spec))


def test_vllm_ep_experts_not_divisible() -> None:
    m = model("tiny-qwen3-moe", num_experts=6)
    with pytest.raises(
        LayoutError, match=r"vllm: mlp\.experts\.routed_experts\.w13_weight: E=6 not divisible by ep=4"
    ):
        VllmLayout().validate(m, ParallelSpec(tp=4, ep=4))
    with pytest.raises(
        LayoutError, match=r"megatron: mlp\.experts\.gate_proj\.weight: Im=32 not divisible by etp=3"
    ):
        MegatronLayout().validate(model("tiny-qwen3-moe"), ParallelSpec(tp=1, dp=3, etp=3))


# ---------------------------------------------------------------- the planner's Kimi-K2 case


def test_kimi_k2_shards_hold_every_expert_once() -> None:
    """Every Kimi-K2 shard at the scale bench's 384-rank topology builds (how long it takes is
    measured by `make bench-scale`, not asserted here), and every routed expert has one holder."""
    m = build_manifest(load_model_config("kimi-k2"))
    # 61 layers over 8 stages: Megatron needs explicit stage sizes (its layout string) for that.
    counts = (8, 8, 8, 8, 8, 7, 7, 7)
    src, dst = ParallelSpec(tp=8, pp=8, dp=4, ep=32, layer_counts=counts), ParallelSpec(tp=16, ep=16)
    src_ranks, dst_ranks = enumerate_ranks(src, SRC), enumerate_ranks(dst, DST)
    meg, vl = MegatronLayout(), VllmLayout()  # fresh caches
    shards = [meg.shard(m, src, c) for c in src_ranks] + [vl.shard(m, dst, c) for c in dst_ranks]
    expert_pieces = sum(1 for s in shards[: len(src_ranks)] for p in s.pieces if ".experts." in p.tensor)
    # tp*dp = 32 = ep, so edp = 1: every expert tensor is held by exactly one source rank.
    assert expert_pieces == 60 * 384 * 3
