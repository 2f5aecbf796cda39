"""Which families a Megatron-Core source serves, and the converter's names for the new ones.

Gemma 3 is refused by `MegatronSource` (and by the test harness's config builder) in one line
naming the family and what is missing, before any Megatron state is touched. The converter's
Llama `mlp_bias` biases, Mixtral's checkpoint names and gpt-oss's fused experts are checked on
hand-made full Megatron tensors (the real-rank proof is tests/engines/test_megatron_families.py).
"""

from __future__ import annotations

import pytest
import torch

from sync_runtime.core.models import load_model_config
from sync_runtime.engines.megatron import MEGATRON_SOURCE_REFUSES, MegatronSource, refuse_unsupported_family
from sync_runtime.engines.megatron_convert import to_hf
from sync_runtime.errors import LayoutError
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.megatron_models import megatron_config

pytestmark = pytest.mark.unit

REFUSED = [
    ("tiny-gemma3", "megatron: gemma3_text: Megatron-Core 0.19.2 has no Gemma 3 layer"),
]


@pytest.mark.parametrize(("preset", "start"), REFUSED)
def test_refused_in_one_line_naming_family_and_what_is_missing(preset: str, start: str) -> None:
    config = load_model_config(preset)
    with pytest.raises(LayoutError) as e:
        refuse_unsupported_family(config)
    message = str(e.value)
    assert message.startswith(start) and "\n" not in message, message


@pytest.mark.parametrize(("preset", "start"), REFUSED)
def test_source_and_harness_refuse_before_touching_megatron(preset: str, start: str) -> None:
    config = load_model_config(preset)
    # No parallel state exists here: a refusal that came later would fail differently.
    with pytest.raises(LayoutError, match=f"^{start}"):
        MegatronSource([], config, gather_dtypes=False)
    with pytest.raises(LayoutError, match=f"^{start}"):
        megatron_config(config, spec=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        {**load_model_config("tiny-llama"), "mlp_bias": True},
        load_model_config("tiny-mixtral"),
        load_model_config("tiny-glm4-moe"),
        load_model_config("tiny-qwen3-moe"),
        load_model_config("tiny-deepseek-v3"),
        load_model_config("tiny-gpt-oss"),
    ],
    ids=["llama-mlp-bias", "mixtral", "glm4-moe", "qwen3-moe", "deepseek-v3", "gpt-oss"],
)
def test_built_families_pass(config: dict) -> None:
    refuse_unsupported_family(config)  # no exception
    assert build_manifest(config).family not in MEGATRON_SOURCE_REFUSES


def test_mlp_bias_fc1_is_gate_then_up_and_fc2_is_down() -> None:
    config = {**load_model_config("tiny-llama"), "mlp_bias": True}
    fc1, fc2 = torch.arange(2 * 128.0), torch.arange(128.0) + 1000
    hf = to_hf(
        {"decoder.layers.2.mlp.linear_fc1.bias": fc1, "decoder.layers.2.mlp.linear_fc2.bias": fc2}, config
    )
    assert torch.equal(hf["model.layers.2.mlp.gate_proj.bias"], fc1[:128])
    assert torch.equal(hf["model.layers.2.mlp.up_proj.bias"], fc1[128:])
    assert torch.equal(hf["model.layers.2.mlp.down_proj.bias"], fc2)


def test_mixtral_experts_and_router_get_the_checkpoints_names() -> None:
    config = load_model_config("tiny-mixtral")
    manifest = {t.name for t in build_manifest(config).tensors}
    fc1 = torch.arange(2 * 32 * 64.0).reshape(64, 64)
    hf = to_hf(
        {
            "decoder.layers.1.mlp.router.weight": torch.zeros(8, 64),
            "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight": fc1,
            "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight": torch.ones(64, 32),
        },
        config,
    )
    p = "model.layers.1.block_sparse_moe."
    want = {f"{p}gate.weight", *(f"{p}experts.5.{w}.weight" for w in ("w1", "w2", "w3"))}
    assert set(hf) == want and want <= manifest
    assert torch.equal(hf[f"{p}experts.5.w1.weight"], fc1[:32])  # w1 = gate: fc1's first half
    assert torch.equal(hf[f"{p}experts.5.w3.weight"], fc1[32:])  # w3 = up
    # Control: a dense MLP tensor keeps the Qwen form (not in Mixtral's manifest): the rename
    # is confined to routed MoE blocks.
    dense = to_hf({"decoder.layers.1.mlp.linear_fc1.weight": fc1}, config)
    assert set(dense) == {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    assert not set(dense) & manifest


def test_gpt_oss_experts_fuse_interleaved_and_the_rest_keeps_gpt_oss_names() -> None:
    config = load_model_config("tiny-gpt-oss")  # E=8, Im=64, H=64, nh=8
    manifest = {t.name: t.shape for t in build_manifest(config).tensors}
    g = torch.Generator().manual_seed(0)
    full = {
        "decoder.layers.2.self_attention.core_attention.softmax_offset": torch.randn(8, generator=g),
        "decoder.layers.2.self_attention.linear_proj.bias": torch.randn(64, generator=g),
        "decoder.layers.2.mlp.router.weight": torch.randn(8, 64, generator=g),
        "decoder.layers.2.mlp.router.bias": torch.randn(8, generator=g),
    }
    for e in range(8):
        x = f"decoder.layers.2.mlp.experts.local_experts.{e}."
        full[x + "linear_fc1.weight"] = torch.randn(128, 64, generator=g)
        full[x + "linear_fc1.bias"] = torch.randn(128, generator=g)
        full[x + "linear_fc2.weight"] = torch.randn(64, 64, generator=g)
        full[x + "linear_fc2.bias"] = torch.randn(64, generator=g)
    hf = to_hf(full, config)
    p = "model.layers.2."
    fused = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    want = {f"{p}self_attn.{x}" for x in ("sinks", "o_proj.bias")}
    want |= {f"{p}mlp.router.{x}" for x in ("weight", "bias")} | {f"{p}mlp.experts.{x}" for x in fused}
    assert {n: tuple(t.shape) for n, t in hf.items()} == {n: manifest[n] for n in want}
    assert torch.equal(
        hf[p + "self_attn.sinks"], full["decoder.layers.2.self_attention.core_attention.softmax_offset"]
    )
    assert torch.equal(hf[p + "mlp.router.bias"], full["decoder.layers.2.mlp.router.bias"])
    for e in (0, 5):
        x = f"decoder.layers.2.mlp.experts.local_experts.{e}."
        fc1, bias = full[x + "linear_fc1.weight"], full[x + "linear_fc1.bias"]
        gate_up = hf[p + "mlp.experts.gate_up_proj"][e]  # (H, 2Im): gate = even columns
        assert torch.equal(gate_up[:, 0::2], fc1[:64].T) and torch.equal(gate_up[:, 1::2], fc1[64:].T)
        fused_bias = hf[p + "mlp.experts.gate_up_proj_bias"][e]
        assert torch.equal(fused_bias[0::2], bias[:64]) and torch.equal(fused_bias[1::2], bias[64:])
        assert torch.equal(hf[p + "mlp.experts.down_proj"][e], full[x + "linear_fc2.weight"].T)
        assert torch.equal(hf[p + "mlp.experts.down_proj_bias"][e], full[x + "linear_fc2.bias"])
    # Control: gate/up not interleaved (Megatron's halves as they are) would be another tensor.
    assert not torch.equal(
        hf[p + "mlp.experts.gate_up_proj"][0],
        full["decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight"].T,
    )
