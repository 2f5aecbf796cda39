"""The manifest derived from transformers' own model class on the meta device, and the layout
tables (core/models/hf_layout.py) that turn transformers' state into the checkpoint's form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.core.manifest import MTP_PART
from sync_runtime.core.models import available_presets, load_model_config, model_dims
from sync_runtime.core.models.hf_layout import (
    CHECKPOINT_ORDER,
    MTP_ONLY,
    UNFUSE,
    checkpoint_name,
    checkpoint_tensors,
    manifest_of,
    unfuse,
)
from sync_runtime.errors import ModelConfigError
from sync_runtime.runtime import hf_manifest
from sync_runtime.runtime.hf_manifest import _hf_config, _hf_fields, build_manifest, meta_state

pytestmark = pytest.mark.unit

# Router biases are buffers in transformers (not counted as parameters) but checkpoint tensors,
# F32 in the checkpoints and in transformers.
_BUFFER_SUFFIXES = ("e_score_correction_bias",)
_UPCAST_ON_LOAD = ("mlp.gate.weight",)


@pytest.mark.parametrize("preset", available_presets())
def test_preset_manifest_has_transformers_parameters(preset: str) -> None:
    config = load_model_config(preset)
    manifest = build_manifest(config)
    meta = meta_state(config)
    checkpoint = meta.checkpoint_form(manifest.family)
    assert {t.name: t.shape for t in manifest.tensors} == {n: s for n, s, _ in checkpoint}
    buffers = [t for t in manifest.tensors if t.name.endswith(_BUFFER_SUFFIXES)]
    assert manifest.nbytes == meta.parameter_count * 2 + sum(t.numel * 4 for t in buffers)
    # dtypes as the checkpoints store them: the config's, the router biases F32 (transformers holds
    # them so too). DeepSeek-V3 and GLM-4.5 store the router weight bf16; transformers upcasts it
    # on load (`_keep_in_fp32_modules_strict`), so its meta dtype is not the checkpoint's.
    dtypes = {n: d for n, _, d in checkpoint if not n.endswith(_UPCAST_ON_LOAD)}
    assert {t.name: t.dtype for t in manifest.tensors if t.name in dtypes} == dtypes
    assert bool(meta.tied) == bool(config.get("tie_word_embeddings"))
    # The MTP part (model.layers.{L}.*, DeepSeek-V3) is no tensor of transformers' class.
    assert not {t.name for t in manifest.mtp} & {n for n, _, _ in checkpoint}
    deepseek_mtp = manifest.family == "deepseek_v3" and (config.get("num_nextn_predict_layers") or 0) > 0
    assert bool(manifest.mtp) == deepseek_mtp


def test_different_config_gives_different_tensors() -> None:
    # Negative control: the manifest follows the config (a wrong head count changes k_proj).
    config = load_model_config("tiny-llama")
    wrong = {**config, "num_key_value_heads": config["num_attention_heads"]}
    assert {t.name: t.shape for t in build_manifest(config).tensors} != {
        t.name: t.shape for t in build_manifest(wrong).tensors
    }


def test_state_is_cached_per_config_and_shared_by_weightsync_keys() -> None:
    config = load_model_config("tiny-qwen3")
    name = "model.norm.weight"
    assert meta_state(config) is meta_state(dict(config))
    assert meta_state(config) is meta_state(config | {"weightsync_tensor_dtypes": {name: "float32"}})
    assert meta_state(config) is not meta_state(config | {"num_hidden_layers": 1})
    assert (
        build_manifest(config | {"weightsync_tensor_dtypes": {name: "float32"}}).by_name()[name].dtype
        == "float32"
    )


def test_state_cached_on_disk_per_transformers_version(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path))
    monkeypatch.setattr(hf_manifest, "_CACHE", type(hf_manifest._CACHE)())
    config = load_model_config("tiny-qwen3-moe")
    built = meta_state(config)
    files = list(tmp_path.glob("hf-state/transformers-*/*.json"))
    assert len(files) == 1
    hf_manifest._CACHE.clear()
    assert meta_state(config) == built  # read back from the file
    files[0].write_text("{torn")  # negative control: a torn file is read again from transformers
    hf_manifest._CACHE.clear()
    assert meta_state(config) == built and json.loads(files[0].read_text())["state"]
    # A planner process that finds the file imports neither transformers nor torch.
    probe = (
        "import json, sys; from sync_runtime.runtime.hf_manifest import build_manifest; "
        f"m = build_manifest(json.loads({json.dumps(json.dumps(config))})); "
        "print(len(m.tensors), 'transformers' in sys.modules, 'torch' in sys.modules)"
    )
    env = {**os.environ, "WEIGHTSYNC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(len(build_manifest(config).tensors)), "False", "False"], out.stderr


def test_disk_cache_keeps_the_most_recently_used(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path))
    monkeypatch.setattr(hf_manifest, "_CACHE", type(hf_manifest._CACHE)())
    monkeypatch.setattr(hf_manifest, "_MAX_ON_DISK", 2)
    base = load_model_config("tiny-qwen3")
    a, b, c = (base | {"num_hidden_layers": n} for n in (1, 2, 3))

    def on_disk() -> set[str]:
        return {f.stem for f in tmp_path.glob("hf-state/transformers-*/*.json")}

    for config in (a, b):
        meta_state(config)
        time.sleep(0.02)  # distinct modification times
    assert on_disk() == {hf_manifest._key(a), hf_manifest._key(b)}
    hf_manifest._CACHE.clear()
    meta_state(a)  # read from its file: now the most recently used
    time.sleep(0.02)
    meta_state(c)
    assert on_disk() == {hf_manifest._key(a), hf_manifest._key(c)}  # b, the least recent, went


def test_unknown_model_refused_in_one_line() -> None:
    with pytest.raises(ModelConfigError) as info:
        build_manifest({"model_type": "not_a_model", "architectures": ["NotAModelForCausalLM"]})
    assert "\n" not in str(info.value)
    assert "not_a_model" in str(info.value) and "transformers" in str(info.value)


def test_missing_transformers_is_one_line(monkeypatch) -> None:
    monkeypatch.setattr(hf_manifest, "_CACHE", type(hf_manifest._CACHE)())
    monkeypatch.setattr(hf_manifest, "_disk_path", lambda key: None)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an install without it does
    with pytest.raises(ModelConfigError, match="needs transformers") as info:
        build_manifest(load_model_config("tiny-llama"))
    assert "\n" not in str(info.value)


def test_plan_refuses_unknown_model_with_exit_2_in_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "not_a_model", "architectures": ["NotAModelForCausalLM"]}))
    assert cli.main(["plan", "--model", str(bad), "--src", "tp=1", "--dst", "tp=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a causal language model transformers knows" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("model_type", ["phi3", "olmo2"])
def test_family_without_layout_rules_refused_in_one_line(model_type: str, tmp_path, capsys) -> None:
    # transformers knows these (their meta model builds), but no layout has rules for their family
    # (phi3 fuses qkv_proj and gate_up_proj in its checkpoint, olmo2 has other norms than Llama's).
    # pad_token_id: phi3's default (32000) is outside the tiny vocabulary.
    config = {
        **load_model_config("tiny-llama"),
        "model_type": model_type,
        "architectures": [],
        "pad_token_id": 0,
    }
    assert meta_state(config).state  # transformers builds it
    with pytest.raises(ModelConfigError, match=f"model_type='{model_type}'.*unknown model family") as info:
        build_manifest(config)
    assert "\n" not in str(info.value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert cli.main(["plan", "--model", str(path), "--src", "tp=1", "--dst", "tp=1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_explicit_head_dim_builds_despite_transformers_architecture_check() -> None:
    # transformers 5.2x refuses hidden_size % num_attention_heads != 0 even when head_dim is given;
    # no weight depends on it then. Without head_dim the refusal stands, in one line.
    config = load_model_config("tiny-llama") | {
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 8,
    }
    q = build_manifest(config).by_name()["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (96, config["hidden_size"])
    assert config["hidden_size"] % config["num_attention_heads"] != 0  # the check's case, really
    built = _hf_config("llama", _hf_fields(config))  # every given field as given, hidden_size too
    given = {k: v for k, v in _hf_fields(config).items() if k != "torch_dtype"}  # held as torch.dtype
    assert {k: getattr(built, k) for k in given} == given
    no_head_dim = {k: v for k, v in config.items() if k != "head_dim"} | {"hidden_size": 100}
    with pytest.raises(ModelConfigError) as info:
        meta_state(no_head_dim)
    assert "\n" not in str(info.value)


def test_kimi_k2_resolves_through_its_architecture() -> None:
    meta = meta_state(load_model_config("tiny-deepseek-v3") | {"model_type": "kimi_k2"})
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
    # In checkpoint order: expert by expert, gate, up, down (the fused block lists gates+ups first).
    state = [(f"model.layers.3.{s}", shape, "bfloat16") for s, shape in fused.items()]
    names = [n for n, _, _ in checkpoint_tensors(state, "qwen3_moe")]
    assert names[:4] == [
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.3.mlp.experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.0.down_proj.weight",
        "model.layers.3.mlp.experts.1.gate_proj.weight",
    ]
    assert [n for n, _, _ in checkpoint_tensors(state, "gpt_oss")] == [n for n, _, _ in state]  # stored fused


def test_mixtral_checkpoint_names_round_trip() -> None:
    # transformers' name -> checkpoint name -> the layouts' canonical view gives the first back.
    from sync_runtime.core.layouts._rules import model_view

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


@pytest.mark.parametrize(
    ("preset", "moved", "anchor"),
    [
        ("tiny-qwen3-moe", "mlp.gate.weight", "mlp.experts.0.gate_proj.weight"),
        ("tiny-gpt-oss", "self_attn.sinks", "self_attn.o_proj"),
    ],
)
def test_checkpoint_order_table_round_trips(preset: str, moved: str, anchor: str, monkeypatch) -> None:
    config = load_model_config(preset)
    dims = model_dims(config)
    assert dims.family in CHECKPOINT_ORDER
    state = meta_state(config).state
    ordered = [t.name for t in build_manifest(config).tensors]
    unordered = [n for n, _, _ in checkpoint_tensors(state, dims.family)]
    # The same tensors, a different order (negative control: the table is what moves them) ...
    assert sorted(ordered) == sorted(unordered) and ordered != unordered
    # ... and where the table says, in every layer that has the tensor.
    layer = next(i for i in range(dims.num_layers) if f"model.layers.{i}.{moved}" in ordered)
    at = ordered.index(f"model.layers.{layer}.{moved}")
    neighbour = ordered[at + 1] if moved == "mlp.gate.weight" else ordered[at - 1]
    assert neighbour.startswith(f"model.layers.{layer}.{anchor}")
    # Without the table's entry transformers' order stands: the table is all that moves them.
    monkeypatch.delitem(CHECKPOINT_ORDER, dims.family)
    assert [t.name for t in manifest_of(config, dims, state).tensors] == unordered


def test_router_bias_only_with_noaux_tc_routing() -> None:
    # transformers' DeepSeek-V3 router always holds e_score_correction_bias; checkpoints (and vLLM)
    # have it only with noaux_tc routing (NOT_IN_CHECKPOINT).
    config = load_model_config("tiny-deepseek-v3")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert config.get("topk_method") == "noaux_tc"
    assert name in build_manifest(config).by_name()
    greedy = config | {"topk_method": "greedy"}
    assert any(n.endswith("e_score_correction_bias") for n, _, _ in meta_state(greedy).state)
    assert not any(t.name.endswith("e_score_correction_bias") for t in build_manifest(greedy).tensors)


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


def test_mtp_layers_derived_from_the_models_own_layers() -> None:
    config = load_model_config("tiny-deepseek-v3") | {"num_nextn_predict_layers": 2}
    manifest = build_manifest(config)
    n = config["num_hidden_layers"]
    assert {t.part for t in manifest.mtp} == {MTP_PART}
    last = [t for t in manifest.tensors if t.name.startswith(f"model.layers.{n - 1}.")]
    for k in range(2):
        prefix = f"model.layers.{n + k}."
        layer = [t for t in manifest.mtp if t.name.startswith(prefix)]
        before = [s for s, where, _ in MTP_ONLY if where == "before"]
        after = [s for s, where, _ in MTP_ONLY if where == "after"]
        assert [t.name[len(prefix) :] for t in layer[: len(before)]] == before
        assert [t.name[len(prefix) :] for t in layer[len(layer) - len(after) :]] == after
        # The decoder block: the model's last (MoE) layer's tensors, renamed, same shapes and dtypes.
        block = layer[len(before) : len(layer) - len(after)]
        assert [(t.name[len(prefix) :], t.shape, t.dtype) for t in block] == [
            (t.name[len(f"model.layers.{n - 1}.") :], t.shape, t.dtype) for t in last
        ]
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        shapes = {t.name[len(prefix) :]: t.shape for t in layer}
        assert shapes["eh_proj.weight"] == (hidden, 2 * hidden)
        assert shapes["embed_tokens.weight"] == shapes["shared_head.head.weight"] == (vocab, hidden)


def test_mtp_layer_without_a_template_is_refused() -> None:
    # An MTP layer that is MoE by DeepSeek's rule, in a model whose layers are all dense.
    config = load_model_config("tiny-deepseek-v3")
    dense = config | {"first_k_dense_replace": config["num_hidden_layers"] - 1, "moe_layer_freq": 1}
    dense |= {"num_nextn_predict_layers": 1}
    assert build_manifest(dense).mtp  # the model's last layer is MoE: a template
    all_dense = dense | {"first_k_dense_replace": config["num_hidden_layers"]}
    with pytest.raises(ModelConfigError, match=r"MTP layer .* is MoE, but the model has no MoE layer"):
        build_manifest(all_dense)
