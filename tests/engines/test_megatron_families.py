"""The newer families on real Megatron-Core 0.19.2 trainer ranks (local spec, gloo, Ray actors).

Llama with `mlp_bias`, Mixtral, GLM-4.5 (`glm4_moe`) and gpt-oss are built by Megatron-Core from
their tiny presets with seeded weights and synced to blank vLLM-layout destinations; every
destination rank is checked bit for bit against canonical HF tensors converted from the Megatron
shards by their own split attributes (`engines.megatron_convert`), with a scrambled-weight control
each, and the converted tensors give transformers' own model the Megatron model's logits (gpt-oss
with plain RoPE on both sides and its sliding-window mask built on the CPU: megatron_cpu).
Gemma 3 is refused by the trainer in one line (engines.megatron.MEGATRON_SOURCE_REFUSES).
One set of 4 trainer actors serves the module; each case rebuilds them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from sync_runtime.core.models import TENSOR_DTYPES_KEY, load_model_config
from sync_runtime.errors import LayoutError
from sync_runtime.schema.report import SyncResult
from sync_runtime.testing.megatron_deploy import MegatronDeployment

pytestmark = pytest.mark.engines

WORLD = 4


@pytest.fixture(scope="module")
def dep(ray_address: str):
    deployment = MegatronDeployment.start(WORLD, "ws-megatron-families", src_prefix="mfam-")
    yield deployment
    deployment.close()


def _llama_mlp_bias() -> dict[str, Any]:
    return {**load_model_config("tiny-llama"), "mlp_bias": True}


def _scrambled_source_fails(
    dep: MegatronDeployment, built: list[dict[str, Any]], address: str, name: str, pp_rank: int
) -> None:
    """Negative control: `name` reversed on every rank of stage `pp_rank` (replicas included, so
    whichever rank sends it sends scrambled bytes); the next sync must fail the bit-exact check."""
    reference = dep.reference()
    holders = [h for h, b in zip(dep.trainers, built, strict=True) if b["coord"].pp_rank == pp_rank]
    ray.get([h.scramble.remote(name) for h in holders])
    assert dep.sync("scrambled", address).result is SyncResult.SUCCEEDED
    problems = dep.verify(reference, "scrambled")
    assert problems and all("differ from the reference" in p for p in problems), problems


def test_llama_mlp_bias_tp2_pp2(dep: MegatronDeployment, ray_address: str) -> None:
    built = dep.build(_llama_mlp_bias(), "tp=2,pp=2", dst="tp=2")
    assert built[0]["layout"] == "megatron"
    ray.get([h.randomize_norms.remote(5) for h in dep.trainers])  # biases start at 0: make them differ
    reference = dep.sync_and_verify("v1", ray_address)
    gate, up = reference["model.layers.3.mlp.gate_proj.bias"], reference["model.layers.3.mlp.up_proj.bias"]
    assert gate.shape == up.shape == (256,) and not torch.equal(gate, up)  # I=256
    assert "model.layers.3.self_attn.o_proj.bias" not in reference  # the MLP alone is biased
    # Stage 1 holds global layers 2 and 3 as local 0 and 1: fc1's bias is [gate; up] rows r-th of t.
    _scrambled_source_fails(dep, built, ray_address, "decoder.layers.1.mlp.linear_fc1.bias", pp_rank=1)


def test_mixtral_tp2_ep2(dep: MegatronDeployment, ray_address: str) -> None:
    built = dep.build(load_model_config("tiny-mixtral"), "tp=2,ep=2", dst="tp=2,ep=2")
    assert {b["coord"].ep_rank for b in built} == {0, 1} and built[0]["spec"].dp == 2
    reference = dep.sync_and_verify("v1", ray_address)
    assert "model.layers.3.block_sparse_moe.experts.7.w3.weight" in reference
    assert "model.layers.3.block_sparse_moe.gate.weight" in reference
    _scrambled_source_fails(
        dep, built, ray_address, "decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight", pp_rank=0
    )


def test_glm4_moe_tp2_pp2_ep2(dep: MegatronDeployment, ray_address: str) -> None:
    # Layer 0 dense (first_k_dense_replace=1) on stage 0 next to a MoE layer; shared experts,
    # q/k/v biases, qk norm, an fp32 router expert_bias.
    built = dep.build(load_model_config("tiny-glm4-moe"), "tp=2,pp=2,ep=2", dst="tp=2")
    assert sorted((b["coord"].pp_rank, b["coord"].ep_rank) for b in built) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    dtypes = built[0]["model_config"][TENSOR_DTYPES_KEY]
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    ray.get([h.randomize_norms.remote(5) for h in dep.trainers])  # norms at 1, biases at 0
    counts = ray.get([h.randomize_expert_bias.remote(6) for h in dep.trainers])
    by_stage = sorted(zip([b["coord"].pp_rank for b in built], counts, strict=True))
    assert [c for _, c in by_stage] == [1, 1, 2, 2]  # MoE layers 1 | 2, 3: every replica set alike
    reference = dep.sync_and_verify("v1", ray_address)
    assert reference["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)  # the dense layer
    assert reference["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (32, 64)
    assert reference["model.layers.1.self_attn.k_proj.bias"].abs().sum() > 0
    assert reference["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    _scrambled_source_fails(dep, built, ray_address, "decoder.layers.1.mlp.router.expert_bias", pp_rank=1)


def test_gpt_oss_tp2_pp2(dep: MegatronDeployment, ray_address: str) -> None:
    # Megatron-Core builds biased experts at etp=1 only: every rank holds whole experts, sent in the
    # checkpoint's orientation; a vLLM TP rank reads its gate/up pairs (interleaved columns
    # [2lo, 2hi)) out of them. q/k/v/o, router and expert biases, sinks (the rank's heads).
    built = dep.build(load_model_config("tiny-gpt-oss"), "tp=2,pp=2", dst="tp=2")
    assert built[0]["layout"] == "megatron"
    ray.get([h.randomize_vectors.remote(5) for h in dep.trainers])  # biases at 0: TP shares differ
    reference = dep.sync_and_verify("v1", ray_address)
    assert reference["model.layers.3.mlp.experts.gate_up_proj"].shape == (8, 64, 128)
    gate_up_bias = reference["model.layers.3.mlp.experts.gate_up_proj_bias"]
    assert not torch.equal(gate_up_bias[:, 0::2], gate_up_bias[:, 1::2])  # gate and up biases differ
    sinks = reference["model.layers.3.self_attn.sinks"]
    assert sinks.shape == (8,) and not torch.equal(sinks[:4], sinks[4:])  # the TP ranks' heads differ
    assert reference["model.layers.3.self_attn.o_proj.bias"].abs().sum() > 0
    # Stage 1 holds global layer 3 as local 1: an expert's gate/up weight, scrambled in the model.
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    _scrambled_source_fails(dep, built, ray_address, name, pp_rank=1)


def test_gpt_oss_tp2_ep2(dep: MegatronDeployment, ray_address: str) -> None:
    # EP 2 splits the experts (4 per rank, whole), TP 2 the attention; vLLM side EP 2 too.
    built = dep.build(load_model_config("tiny-gpt-oss"), "tp=2,ep=2", dst="tp=2,ep=2")
    assert {b["coord"].ep_rank for b in built} == {0, 1} and built[0]["spec"].dp == 2
    ray.get([h.randomize_vectors.remote(6) for h in dep.trainers])
    reference = dep.sync_and_verify("v1", ray_address)
    assert reference["model.layers.0.mlp.router.bias"].abs().sum() > 0
    _scrambled_source_fails(
        dep, built, ray_address, "decoder.layers.2.self_attention.core_attention.softmax_offset", pp_rank=0
    )


def _gpt_oss_plain_rope() -> dict[str, Any]:
    """tiny-gpt-oss with plain RoPE: Megatron-Core's TransformerConfig has no YaRN fields, so the
    harness builds gpt-oss with rope (no weight depends on it); transformers is told the same. A
    4-token window, shorter than the 12 tokens: the two sides' window rules must agree."""
    config = {k: v for k, v in load_model_config("tiny-gpt-oss").items() if k != "rope_scaling"}
    return {**config, "sliding_window": 4}


def _swap_gate_up(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A plausible mapping bug: gate and up (fc1's [gate; up] halves) exchanged in every
    projection under `prefix` (Mixtral: w1 and w3 of every expert of the block; gpt-oss: the even
    and odd columns of the fused gate_up_proj and its bias)."""
    out = dict(state)
    fused = [n for n in state if n.startswith(prefix) and n.endswith(("gate_up_proj", "gate_up_proj_bias"))]
    for name in fused:
        t = state[name]
        out[name] = torch.stack([t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)
    if fused:
        return out
    gates = [n for n in state if n.startswith(prefix) and n.endswith(("gate_proj.weight", ".w1.weight"))]
    assert gates, prefix
    for gate in gates:
        up = gate.replace("gate_proj", "up_proj").replace(".w1.", ".w3.")
        out[gate], out[up] = state[up], state[gate]
    return out


def _hf_logits(
    config: dict[str, Any], state: dict[str, torch.Tensor], tokens: torch.Tensor, path: Path
) -> torch.Tensor:
    """transformers' logits from `state` saved as a checkpoint and loaded by `from_pretrained`
    (transformers 5 fuses Mixtral's and GLM's experts in memory: its own loader converts)."""
    from safetensors.torch import save_file
    from transformers import (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config["rope_theta"])}
    if "partial_rotary_factor" in config:
        rope["partial_rotary_factor"] = config["partial_rotary_factor"]
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
        "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    }
    config_cls, model_cls = classes[config["model_type"]]
    config_cls(**{**config, "rope_parameters": rope}).save_pretrained(path)
    save_file(
        {n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"), {"format": "pt"}
    )
    model, info = model_cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


@pytest.mark.parametrize(
    ("config_of", "wrong"),
    [
        (_llama_mlp_bias, "model.layers.1.mlp."),
        (lambda: load_model_config("tiny-mixtral"), "model.layers.1.block_sparse_moe.experts."),
        (lambda: load_model_config("tiny-glm4-moe"), "model.layers.1.mlp.shared_experts."),
        (_gpt_oss_plain_rope, "model.layers.1.mlp.experts."),
    ],
    ids=["llama-mlp-bias", "mixtral", "glm4-moe", "gpt-oss"],
)
def test_forward_equivalence_with_transformers(
    dep: MegatronDeployment, config_of: Callable[[], dict[str, Any]], wrong: str, tmp_path: Path
) -> None:
    config = {**config_of(), "rope_theta": float(config_of().get("rope_theta") or 10000.0)}
    dep.build(config, "tp=1", dst="tp=1", init_std=0.2)  # large init: attention is not flat
    ray.get([h.randomize_norms.remote(3) for h in dep.trainers])  # norms and biases: a mix-up shows
    ray.get([h.randomize_expert_bias.remote(4) for h in dep.trainers])
    reference = dep.reference()
    tokens = torch.randint(0, config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    ours = ray.get(dep.trainers[0].logits.remote(tokens))
    max_diff = float((ours - _hf_logits(config, reference, tokens, tmp_path / "ok")).abs().max())
    assert max_diff < 1e-4, max_diff
    # Negative control: gate and up exchanged in the family's own block.
    theirs = _hf_logits(config, _swap_gate_up(reference, wrong), tokens, tmp_path / "swapped")
    bad_diff = float((ours - theirs).abs().max())
    assert bad_diff > 100 * max(max_diff, 1e-6), (bad_diff, max_diff)


def test_gemma3_refused_by_the_trainer(dep: MegatronDeployment) -> None:
    config = load_model_config("tiny-gemma3")
    with pytest.raises(LayoutError, match="no norm after attention or after the MLP") as e:
        dep.build(config, "tp=2", dst="tp=2")
    assert f"megatron: {config['model_type']}: " in str(e.value)
