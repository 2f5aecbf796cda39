"""The hand-written manifests equal transformers' own model class, read on the meta device."""

from __future__ import annotations

import pytest

from sync_runtime.core.models import available_presets, build_manifest, load_model_config
from sync_runtime.engines.hf_meta import UNFUSE, MetaManifest, meta_manifest, unfuse
from sync_runtime.errors import ModelConfigError

pytestmark = pytest.mark.unit

# Router biases are buffers in transformers (not counted as parameters) but checkpoint tensors,
# F32 in the checkpoints and in transformers.
_BUFFER_SUFFIXES = ("e_score_correction_bias",)
_UPCAST_ON_LOAD = ("mlp.gate.weight",)


def _shapes(meta: MetaManifest) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, shape, _ in meta.tensors}


@pytest.mark.parametrize("preset", available_presets())
def test_preset_manifest_equals_transformers(preset: str) -> None:
    config = load_model_config(preset)
    manifest = build_manifest(config)
    meta = meta_manifest(config)
    assert {t.name: t.shape for t in manifest.tensors} == _shapes(meta)
    buffers = [t for t in manifest.tensors if t.name.endswith(_BUFFER_SUFFIXES)]
    assert manifest.nbytes == meta.parameter_count * 2 + sum(t.numel * 4 for t in buffers)
    # dtypes as the checkpoints store them: the config's, the router biases F32 (transformers holds
    # them so too). DeepSeek-V3 and GLM-4.5 store the router weight bf16; transformers upcasts it
    # on load (`_keep_in_fp32_modules_strict`), so its meta dtype is not the checkpoint's.
    dtypes = {n: d for n, _, d in meta.tensors if not n.endswith(_UPCAST_ON_LOAD)}
    assert {t.name: t.dtype for t in manifest.tensors if t.name in dtypes} == dtypes
    assert bool(meta.tied) == bool(config.get("tie_word_embeddings"))
    # The MTP part (model.layers.{L}.*, DeepSeek-V3) is no tensor of transformers' class, which
    # ignores those checkpoint names on load: the manifest keeps it apart from `tensors`.
    assert not {t.name for t in manifest.mtp} & set(_shapes(meta))
    deepseek_mtp = manifest.family == "deepseek_v3" and (config.get("num_nextn_predict_layers") or 0) > 0
    assert bool(manifest.mtp) == deepseek_mtp


def test_different_config_gives_different_tensors() -> None:
    # Negative control: the comparison above sees a wrong head count.
    config = load_model_config("tiny-llama")
    wrong = {**config, "num_key_value_heads": config["num_attention_heads"]}
    assert {t.name: t.shape for t in build_manifest(config).tensors} != _shapes(meta_manifest(wrong))


def test_unknown_model_refused_in_one_line() -> None:
    with pytest.raises(ModelConfigError) as info:
        meta_manifest({"model_type": "not_a_model", "architectures": ["NotAModelForCausalLM"]})
    assert "\n" not in str(info.value)
    assert "not_a_model" in str(info.value)


def test_kimi_k2_resolves_through_its_architecture() -> None:
    meta = meta_manifest(load_model_config("tiny-deepseek-v3") | {"model_type": "kimi_k2"})
    assert meta.model_class == "DeepseekV3ForCausalLM"


def test_unfuse_table_round_trips() -> None:
    # Stacking the per-expert parts back (rows concatenated, experts stacked) gives the fused shape.
    experts, inter, hidden = 4, 6, 10
    fused = {
        "mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
        "mlp.experts.down_proj": (experts, hidden, inter),
    }
    assert set(fused) == set(UNFUSE)
    for suffix, shape in fused.items():
        parts = unfuse(f"model.layers.3.{suffix}", shape, "bfloat16")
        assert len(parts) == experts * len(UNFUSE[suffix])
        per_expert = [p for p in parts if p[0].startswith("model.layers.3.mlp.experts.2.")]
        assert sum(s[0] for _, s, _ in per_expert) == shape[1]
        assert {s[1] for _, s, _ in per_expert} == {shape[2]}
    assert unfuse("model.norm.weight", (10,), "bfloat16") == [("model.norm.weight", (10,), "bfloat16")]


def test_mixtral_checkpoint_names_round_trip() -> None:
    # transformers' name -> checkpoint name -> the layouts' canonical view gives the first back.
    from sync_runtime.core.layouts._rules import model_view
    from sync_runtime.engines.hf_meta import checkpoint_name

    hf = "model.layers.5.mlp.experts.3.up_proj.weight"
    assert checkpoint_name(hf, "mixtral") == "model.layers.5.block_sparse_moe.experts.3.w3.weight"
    assert (
        checkpoint_name("model.layers.5.mlp.gate.weight", "mixtral")
        == "model.layers.5.block_sparse_moe.gate.weight"
    )
    assert checkpoint_name(hf, "qwen3_moe") == hf
    view = model_view(build_manifest(load_model_config("mixtral-8x7b")))
    expert = view.layers[5].experts[3]
    assert expert["up_proj.weight"].name == "model.layers.5.block_sparse_moe.experts.3.w3.weight"
    assert view.layers[5].dense["mlp.gate.weight"].name == "model.layers.5.block_sparse_moe.gate.weight"


def test_router_bias_is_f32_in_a_bf16_model() -> None:
    # DeepSeek-V3 / Kimi-K2 / GLM-4.5 checkpoints store e_score_correction_bias F32: 4 bytes each.
    for preset in ("deepseek-v3", "glm-4.5-air", "kimi-k2"):
        manifest = build_manifest(load_model_config(preset))
        biases = [t for t in manifest.tensors if t.name.endswith("e_score_correction_bias")]
        assert biases and {t.dtype for t in biases} == {"float32"}
        assert {t.dtype for t in manifest.tensors} == {"bfloat16", "float32"}
    # weightsync_tensor_dtypes still overrides it (a source holding it otherwise says so).
    config = load_model_config("tiny-deepseek-v3")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    overridden = build_manifest(config | {"weightsync_tensor_dtypes": {name: "bfloat16"}})
    assert overridden.by_name()[name].dtype == "bfloat16"
    assert build_manifest(config).by_name()[name].dtype == "float32"
