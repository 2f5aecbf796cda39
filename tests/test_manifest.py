"""Manifests built from config.json: names, shapes, counts and errors (design §3)."""

from __future__ import annotations

import json

import pytest

from sync_runtime.core.models import available_presets, load_model_config, model_dims
from sync_runtime.errors import ModelConfigError
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit


def manifest(preset: str, **overrides: object):
    return build_manifest({**load_model_config(preset), **overrides})


def shapes(preset: str, **overrides: object) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in manifest(preset, **overrides).tensors}


def test_presets_listed_and_all_build() -> None:
    names = available_presets()
    for required in (
        "tiny-llama",
        "tiny-llama-tied",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-qwen3-moe",
        "tiny-deepseek-v3",
        "mid-qwen3-moe",
        "llama-3-70b",
        "qwen3-235b-a22b",
        "deepseek-v3",
        "kimi-k2",
    ):
        assert required in names
    for name in names:
        m = manifest(name)
        assert len({t.name for t in m.tensors}) == len(m.tensors), f"{name}: duplicate tensor names"
        # bf16 checkpoints; the router biases of DeepSeek-V3/Kimi-K2/GLM-4.5 are stored F32.
        assert all(t.dtype == "bfloat16" or t.name.endswith("e_score_correction_bias") for t in m.tensors)


def test_llama_names_and_shapes() -> None:
    s = shapes("tiny-llama")  # H=128, nh=8, nkv=2, d=16, I=256, V=1000, L=4, untied
    assert s["model.embed_tokens.weight"] == (1000, 128)
    assert s["lm_head.weight"] == (1000, 128)
    assert s["model.norm.weight"] == (128,)
    assert s["model.layers.3.self_attn.q_proj.weight"] == (128, 128)
    assert s["model.layers.3.self_attn.k_proj.weight"] == (32, 128)
    assert s["model.layers.3.self_attn.v_proj.weight"] == (32, 128)
    assert s["model.layers.3.self_attn.o_proj.weight"] == (128, 128)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (256, 128)
    assert s["model.layers.0.mlp.down_proj.weight"] == (128, 256)
    assert s["model.layers.0.input_layernorm.weight"] == (128,)
    assert len(s) == 1 + 4 * 9 + 2
    assert not any("bias" in n or "q_norm" in n for n in s)


def test_tied_has_no_lm_head() -> None:
    assert "lm_head.weight" not in shapes("tiny-llama-tied")
    assert "lm_head.weight" in shapes("tiny-llama-tied", tie_word_embeddings=False)


def test_qwen2_biases_and_qwen3_qk_norm() -> None:
    s = shapes("tiny-qwen2")  # nh=4, nkv=2, d=16
    assert s["model.layers.1.self_attn.q_proj.bias"] == (64,)
    assert s["model.layers.1.self_attn.k_proj.bias"] == (32,)
    assert s["model.layers.1.self_attn.v_proj.bias"] == (32,)
    assert "model.layers.1.self_attn.o_proj.bias" not in s
    q3 = shapes("tiny-qwen3")  # explicit head_dim=32 != H/nh=16
    assert q3["model.layers.0.self_attn.q_proj.weight"] == (8 * 32, 128)
    assert q3["model.layers.0.self_attn.o_proj.weight"] == (128, 8 * 32)
    assert q3["model.layers.0.self_attn.q_norm.weight"] == (32,)
    assert q3["model.layers.0.self_attn.k_norm.weight"] == (32,)


def test_qwen3_moe_experts_router_and_dense_layers() -> None:
    s = shapes("tiny-qwen3-moe")  # E=8, Im=32, H=64, mlp_only_layers=[1]
    assert s["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert s["model.layers.0.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert s["model.layers.0.mlp.experts.7.up_proj.weight"] == (32, 64)
    assert s["model.layers.0.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert "model.layers.0.mlp.experts.8.gate_proj.weight" not in s
    assert s["model.layers.1.mlp.gate_proj.weight"] == (128, 64)
    assert not any(n.startswith("model.layers.1.mlp.experts") for n in s)
    assert s["model.layers.2.self_attn.q_norm.weight"] == (16,)
    step2 = shapes("tiny-qwen3-moe", decoder_sparse_step=2, mlp_only_layers=[])
    assert "model.layers.1.mlp.gate.weight" in step2 and "model.layers.3.mlp.gate.weight" in step2
    assert "model.layers.0.mlp.gate_proj.weight" in step2 and "model.layers.2.mlp.gate_proj.weight" in step2


def test_deepseek_v3_mla_dense_first_shared_experts_no_mtp() -> None:
    s = shapes("tiny-deepseek-v3")  # H=128 nh=4 q_lora=48 kv_lora=32 nope=16 rope=8 v=16, 3 layers + 1 MTP
    a = "model.layers.1.self_attn."
    assert s[a + "q_a_proj.weight"] == (48, 128)
    assert s[a + "q_a_layernorm.weight"] == (48,)
    assert s[a + "q_b_proj.weight"] == (4 * 24, 48)
    assert s[a + "kv_a_proj_with_mqa.weight"] == (32 + 8, 128)
    assert s[a + "kv_a_layernorm.weight"] == (32,)
    assert s[a + "kv_b_proj.weight"] == (4 * 32, 32)
    assert s[a + "o_proj.weight"] == (128, 4 * 16)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (256, 128)  # first_k_dense_replace=1
    assert "model.layers.0.mlp.gate.weight" not in s
    assert s["model.layers.1.mlp.gate.weight"] == (8, 128)
    assert s["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert s["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (32, 128)
    assert s["model.layers.1.mlp.shared_experts.down_proj.weight"] == (128, 32)
    assert s["model.layers.2.mlp.experts.7.down_proj.weight"] == (128, 32)
    assert not any(n.startswith("model.layers.3.") for n in s), "MTP layer must be excluded"
    no_lora = shapes("tiny-deepseek-v3", q_lora_rank=None)
    assert no_lora[a + "q_proj.weight"] == (4 * 24, 128)
    assert a + "q_a_proj.weight" not in no_lora
    no_bias = shapes("tiny-deepseek-v3", topk_method="greedy")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in no_bias


def _params(preset: str) -> int:
    return sum(t.numel for t in manifest(preset).tensors)


def test_llama_3_70b_counts() -> None:
    m = manifest("llama-3-70b")
    assert len(m.tensors) == 1 + 80 * 9 + 2
    # Independent closed form: 2 V H + L (2 H^2 + 2 H kv + 3 H I + 2 H) + H.
    h, v, inter, kv, layers = 8192, 128256, 28672, 1024, 80
    assert _params("llama-3-70b") == 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) + h
    assert _params("llama-3-70b") == pytest.approx(70.6e9, rel=0.005)  # published "70B" model card: 70.6B


def test_qwen3_235b_counts() -> None:
    m = manifest("qwen3-235b-a22b")
    assert len(m.tensors) == 3 + 94 * (6 + 1 + 128 * 3 + 2)
    assert _params("qwen3-235b-a22b") == pytest.approx(235e9, rel=0.005)  # model card: 235B total


def test_deepseek_v3_counts() -> None:
    m = manifest("deepseek-v3")
    dense, moe = 3 * (7 + 3 + 2), 58 * (7 + 256 * 3 + 2 + 3 + 2)
    assert len(m.tensors) == 3 + dense + moe
    # Model card: 685B on the Hub = 671B main model + 14B MTP module; MTP is excluded here.
    assert _params("deepseek-v3") == pytest.approx(671e9, rel=0.003)


def test_kimi_k2_counts() -> None:
    m = manifest("kimi-k2")
    assert len(m.tensors) == 3 + 1 * 12 + 60 * (7 + 384 * 3 + 2 + 3 + 2)
    assert len(m.tensors) == pytest.approx(70_000, rel=0.01)
    # Model card: "1T total parameters" (one significant digit); the exact sum is 1.026e12.
    assert 1.0e12 <= _params("kimi-k2") <= 1.05e12


def test_dims_mla_and_gqa() -> None:
    d = model_dims(load_model_config("kimi-k2"))
    assert d.family == "deepseek_v3" and d.mla and d.num_experts == 384
    assert d.moe_layers == frozenset(range(1, 61))
    g = model_dims(load_model_config("tiny-llama"))
    assert not g.mla and g.num_kv_heads == 2 and g.head_dim == 16


def test_unknown_family_names_model_type() -> None:
    with pytest.raises(ModelConfigError, match=r"model_type='gpt2'.*unknown model family"):
        build_manifest({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "hidden_size": 8})


def test_missing_field_is_named() -> None:
    config = load_model_config("tiny-llama")
    del config["num_attention_heads"]
    with pytest.raises(ModelConfigError, match="'num_attention_heads' is missing"):
        build_manifest(config)
    moe = load_model_config("tiny-qwen3-moe")
    del moe["moe_intermediate_size"]
    with pytest.raises(ModelConfigError, match="moe_intermediate_size"):
        build_manifest(moe)


def test_bad_values_refused() -> None:
    with pytest.raises(ModelConfigError, match="attention_bias"):
        manifest("tiny-llama", attention_bias=True)
    with pytest.raises(ModelConfigError, match="not a multiple of num_key_value_heads"):
        manifest("tiny-llama", num_key_value_heads=3)
    with pytest.raises(ModelConfigError, match="hidden_size"):
        manifest("tiny-llama", hidden_size=0)


def test_load_from_path_and_missing(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_model_config("tiny-qwen2")))
    assert load_model_config(str(path))["model_type"] == "qwen2"
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_model_config("no-such-preset")
    path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_model_config(path)


def test_architecture_wins_over_model_type() -> None:
    config = load_model_config("kimi-k2")
    assert config["model_type"] == "kimi_k2"
    assert build_manifest(config).family == "deepseek_v3"
