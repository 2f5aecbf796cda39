"""Families added after the first three: names per layout, round trips, real-size plans."""

from __future__ import annotations

import json

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.core.layouts import get_layout
from sync_runtime.core.models import load_model_config
from sync_runtime.core.models.families import LLAMA_LAYOUT
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.errors import LayoutError, ModelConfigError
from sync_runtime.runtime.hf_manifest import build_manifest, meta_state
from tests.test_layouts import GRID as DENSE_GRID
from tests.test_layouts import assert_round_trip
from tests.test_layouts_moe_mla import GRID

pytestmark = pytest.mark.unit

L0 = "model.layers.0."


@pytest.mark.parametrize(("layout", "spec"), [(lay, s) for lay, specs in GRID.items() for s in specs])
def test_mixtral_round_trip(layout: str, spec: str) -> None:
    assert_round_trip(layout, build_manifest(load_model_config("tiny-mixtral")), ParallelSpec.parse(spec))


def test_mixtral_names_per_layout() -> None:
    m = build_manifest(load_model_config("tiny-mixtral"))
    names = {t.name for t in m.tensors}
    assert L0 + "block_sparse_moe.experts.7.w1.weight" in names
    assert L0 + "block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)
    vllm = get_layout("vllm").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.DESTINATION, tp_rank=1))
    local = {t.name: t.shape for t in vllm.tensors}
    # vLLM's MixtralDecoderLayer.block_sparse_moe: FusedMoE w13 = [gate; up] rows, Im/t each.
    assert local[L0 + "block_sparse_moe.experts.routed_experts.w13_weight"] == (8, 32, 64)
    assert local[L0 + "block_sparse_moe.gate.weight"] == (8, 64)
    mg = get_layout("megatron").shard(m, ParallelSpec(tp=2, ep=2), RankCoord(role=Role.SOURCE, ep_rank=1))
    local = {t.name: t.shape for t in mg.tensors}
    assert local["decoder.layers.0.mlp.router.weight"] == (8, 64)
    assert local["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"] == (64, 64)
    w1 = [p for p in mg.pieces if p.tensor == L0 + "block_sparse_moe.experts.7.w1.weight"]
    assert [p.local_name for p in w1] == ["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]


def _llama_mlp_bias() -> dict:
    return load_model_config("tiny-llama") | {"mlp_bias": True}


@pytest.mark.parametrize(("layout", "spec"), [(lay, s) for lay, specs in DENSE_GRID.items() for s in specs])
def test_llama_mlp_bias_round_trip(layout: str, spec: str) -> None:
    m = build_manifest(_llama_mlp_bias())
    parsed = ParallelSpec.parse(spec)
    try:
        get_layout(layout).validate(m, parsed)
    except LayoutError as e:
        # The dense grid's points for 2-layer presets (layers=1+1) do not split this 4-layer model.
        assert "layer_counts" in str(e), str(e)
        return
    assert_round_trip(layout, m, parsed)


def test_llama_mlp_bias_names_and_transformers() -> None:
    config = _llama_mlp_bias()
    m = build_manifest(config)
    meta = meta_state(config)
    assert {t.name: t.shape for t in m.tensors} == {n: s for n, s, _ in meta.checkpoint_form(m.family)}
    assert m.nbytes == meta.parameter_count * 2
    i = config["intermediate_size"]
    vllm = get_layout("vllm").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.DESTINATION, tp_rank=1))
    local = {t.name: t.shape for t in vllm.tensors}
    assert local[L0 + "mlp.gate_up_proj.bias"] == (i,)  # [gate half; up half] of rank 1
    assert local[L0 + "mlp.down_proj.bias"] == (config["hidden_size"],)  # row-parallel bias: whole
    mg = get_layout("megatron").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.SOURCE, tp_rank=1))
    local = {t.name: t.shape for t in mg.tensors}
    assert local["decoder.layers.0.mlp.linear_fc1.bias"] == (i,)
    assert local["decoder.layers.0.mlp.linear_fc2.bias"] == (config["hidden_size"],)


def test_mlp_bias_refused_where_the_model_has_none() -> None:
    # Qwen2's MLP has no bias field: a config saying so is wrong, not silently dropped.
    with pytest.raises(ModelConfigError, match="mlp_bias"):
        build_manifest(load_model_config("tiny-qwen2") | {"mlp_bias": True})


@pytest.mark.parametrize(("layout", "spec"), [(lay, s) for lay, specs in GRID.items() for s in specs])
def test_glm4_moe_round_trip(layout: str, spec: str) -> None:
    assert_round_trip(layout, build_manifest(load_model_config("tiny-glm4-moe")), ParallelSpec.parse(spec))


def test_glm4_moe_names_per_layout() -> None:
    # q/k/v biases (attention_bias), q/k norms, DeepSeek-style MoE after one dense layer.
    m = build_manifest(load_model_config("tiny-glm4-moe"))
    names = {t.name for t in m.tensors}
    assert L0 + "mlp.gate_proj.weight" in names and L0 + "self_attn.q_proj.bias" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert not any(n.endswith("o_proj.bias") for n in names)
    vllm = get_layout("vllm").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.DESTINATION, tp_rank=0))
    local = {t.name: t.shape for t in vllm.tensors}
    assert local["model.layers.1.self_attn.qkv_proj.bias"] == ((4 + 2 + 2) * 16,)
    assert local["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == (32, 64)
    assert local["model.layers.1.mlp.experts.routed_experts.w13_weight"] == (8, 32, 64)
    mg = get_layout("megatron").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.SOURCE))
    local = {t.name: t.shape for t in mg.tensors}
    assert local["decoder.layers.1.self_attention.linear_qkv.bias"] == (128,)
    assert local["decoder.layers.1.mlp.router.expert_bias"] == (8,)


@pytest.mark.parametrize(
    ("layout", "spec"),
    [(lay, s) for lay, specs in DENSE_GRID.items() if lay in ("vllm", "hf") for s in specs],
)
def test_gemma3_round_trip(layout: str, spec: str) -> None:
    m = build_manifest(load_model_config("tiny-gemma3"))
    parsed = ParallelSpec.parse(spec)
    try:
        get_layout(layout).validate(m, parsed)
    except LayoutError as e:
        assert "layer_counts" in str(e), str(e)  # the 2-layer grid points (layers=1+1)
        return
    assert_round_trip(layout, m, parsed)


def test_gemma3_names_and_megatron_refusal() -> None:
    m = build_manifest(load_model_config("tiny-gemma3"))
    vllm = get_layout("vllm").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.DESTINATION))
    local = {t.name: t.shape for t in vllm.tensors}
    for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm"):
        assert L0 + norm + ".weight" in local
    assert "lm_head.weight" not in local  # tied, pp=1
    with pytest.raises(LayoutError, match="gemma3_text"):
        get_layout("megatron").validate(m, ParallelSpec(tp=2))


REAL = [
    ("mixtral-8x7b", "megatron", "tp=4,pp=4,dp=2,ep=8", "tp=8,ep=8"),
    ("glm-4.5-air", "megatron", "tp=4,pp=2,dp=4,ep=8", "tp=8,ep=8"),
    # No Megatron-Core layer spec holds Gemma 3's sandwich norms: an HF-layout (FSDP-style) source.
    ("gemma-3-27b", "hf", "tp=8,pp=2", "tp=8"),
    # gpt-oss from an HF-layout source (a megatron one plans too: tests/test_megatron_gpt_oss_layout.py).
    ("gpt-oss-20b", "hf", "tp=4,pp=2,dp=2,ep=4", "tp=8,ep=8"),
    ("gpt-oss-20b", "hf", "tp=8", "tp=4,replicas=2"),
]


@pytest.mark.parametrize(("preset", "src_layout", "src", "dst"), REAL)
def test_real_config_plans_at_the_lower_bound(
    preset: str, src_layout: str, src: str, dst: str, capsys
) -> None:
    argv = ["plan", "--model", preset, "--src-layout", src_layout, "--src", src, "--dst", dst, "--json"]
    code = cli.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["model_bytes"] == build_manifest(load_model_config(preset)).nbytes
    assert summary["wire_bytes"] == summary["lower_bound_bytes"]


GPT_OSS_GRID = {
    "vllm": ["tp=1", "tp=2", "tp=4", "tp=4,ep=4", "tp=2,pp=3", "tp=2,ep=2,pp=2,replicas=2"],
    "hf": ["tp=1", "tp=2", "tp=4,ep=4", "tp=2,pp=2", "tp=2,dp=2"],
}


@pytest.mark.parametrize(("layout", "spec"), [(lay, s) for lay, specs in GPT_OSS_GRID.items() for s in specs])
def test_gpt_oss_round_trip(layout: str, spec: str) -> None:
    assert_round_trip(layout, build_manifest(load_model_config("tiny-gpt-oss")), ParallelSpec.parse(spec))


def test_gpt_oss_manifest_equals_transformers() -> None:
    # Fused experts as the checkpoint stores them (not unfused), sinks, o_proj and router biases.
    for preset in ("tiny-gpt-oss", "gpt-oss-20b"):
        config = load_model_config(preset)
        m, meta = build_manifest(config), meta_state(config)
        assert {t.name: t.shape for t in m.tensors} == {n: s for n, s, _ in meta.checkpoint_form(m.family)}
        assert m.nbytes == meta.parameter_count * 2
        assert {t.dtype for t in m.tensors} == {"bfloat16"}
    assert meta.parameter_count == 20_914_757_184  # gpt-oss-20b, transformers' own count


def test_gpt_oss_names_per_layout() -> None:
    m = build_manifest(load_model_config("tiny-gpt-oss"))
    names = {t.name: t.shape for t in m.tensors}
    assert names[L0 + "mlp.experts.gate_up_proj"] == (8, 64, 128)  # (E, H, 2Im) interleaved
    assert names[L0 + "self_attn.sinks"] == (8,)
    assert L0 + "self_attn.o_proj.bias" in names and L0 + "mlp.router.bias" in names
    spec = ParallelSpec(tp=2)
    r1 = get_layout("vllm").shard(m, spec, RankCoord(role=Role.DESTINATION, tp_rank=1))
    local = {t.name: t.shape for t in r1.tensors}
    assert "model.embedding.weight" in local and L0 + "attn.qkv_proj.bias" in local
    assert local[L0 + "attn.sinks"] == (4,)
    assert local[L0 + "attn.o_proj.bias"] == (64,)
    experts = L0 + "mlp.experts.routed_experts."
    # Rank 1 holds Im rows [32, 64): gate_up columns [64, 128), whole gate/up pairs.
    (w13,) = [p for p in r1.pieces if p.local_name == experts + "w13_weight"]
    assert w13.canon_box == ((0, 8), (0, 64), (64, 128))
    assert local[experts + "w13_bias"] == (8, 64) and local[experts + "w2_weight"] == (8, 32, 64)
    # vLLM's loader zeroes w2_bias on TP ranks > 0: they receive nothing of it, hold no such tensor.
    assert experts + "w2_bias" not in local
    assert not [p for p in r1.pieces if p.local_name == experts + "w2_bias"]
    r0 = get_layout("vllm").shard(m, spec, RankCoord(role=Role.DESTINATION, tp_rank=0))
    assert [p.canon_box for p in r0.pieces if p.local_name == experts + "w2_bias"] == [((0, 8), (0, 64))]


def test_gpt_oss_refusals() -> None:
    m = build_manifest(load_model_config("tiny-gpt-oss"))
    # The megatron (local spec) layout holds gpt-oss (tests/test_megatron_gpt_oss_layout.py); the
    # Transformer Engine spec's rules for it are not written.
    with pytest.raises(LayoutError, match="no megatron-te rule for gpt-oss"):
        get_layout("megatron-te").validate(m, ParallelSpec(tp=2))
    # vLLM's gpt-oss attention divides nkv by tp: KV heads cannot be replicated.
    with pytest.raises(LayoutError, match="nkv=4 not divisible by tp=8"):
        get_layout("vllm").validate(m, ParallelSpec(tp=8))
    with pytest.raises(ModelConfigError, match="mxfp4"):
        build_manifest(load_model_config("gpt-oss-20b") | {"quantization_config": {"quant_method": "mxfp4"}})


@pytest.mark.parametrize("model_type", sorted(LLAMA_LAYOUT))
def test_llama_layout_families_hold_llamas_tensors(model_type: str) -> None:
    """The LLAMA_LAYOUT table, checked against transformers: its model class for the family holds
    the same tensors (names, shapes, order, ties) as Llama's for the same fields, so planning it
    as `llama` moves every byte it has; and its manifest is Llama's."""
    llama = load_model_config("tiny-llama")
    other = llama | {"model_type": model_type, "architectures": [LLAMA_LAYOUT[model_type]]}
    assert meta_state(other).model_class == LLAMA_LAYOUT[model_type]
    assert meta_state(other).state == meta_state(llama).state
    assert meta_state(other).tied == meta_state(llama).tied
    assert build_manifest(other).tensors == build_manifest(llama).tensors


def test_a_family_outside_the_table_is_not_taken_for_llama() -> None:
    # Control: OLMo 2 builds in transformers but its tensors are not Llama's (q/k norms, other
    # norm placement); the round trip above would fail for it, and it stays refused.
    llama = load_model_config("tiny-llama")
    olmo2 = llama | {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}
    assert meta_state(olmo2).state != meta_state(llama).state
    with pytest.raises(ModelConfigError, match="unknown model family"):
        build_manifest(olmo2)


@pytest.mark.parametrize(("src", "dst"), [("tp=4,pp=2,dp=2", "tp=2,replicas=4"), ("tp=8", "tp=4")])
def test_mistral_7b_plans_at_the_lower_bound_with_transformers_byte_count(src: str, dst: str, capsys) -> None:
    argv = ["plan", "--model", "mistral-7b", "--src", src, "--dst", dst, "--json"]
    code = cli.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    count = meta_state(load_model_config("mistral-7b")).parameter_count
    assert count == 7_241_732_096  # Mistral-7B's published parameter count
    assert summary["model_bytes"] == 2 * count
    assert summary["wire_bytes"] == summary["lower_bound_bytes"]
