"""Real Megatron-Core 0.19.2 trainer ranks (local spec, gloo, Ray actors) as WeightSync sources.

One set of 4 trainer actors serves the module (process start + `import megatron` dominate on a
small machine); each case rebuilds them with another model and parallelism. Every check of a
destination is bit for bit against canonical HF tensors converted from the Megatron shards by
Megatron's own split attributes (`engines.megatron_convert`), not by the layout under test.
"""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch

from sync_runtime.core.models import TENSOR_DTYPES_KEY, load_model_config
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.errors import LayoutError
from sync_runtime.schema.report import SyncResult
from sync_runtime.testing.megatron_deploy import MegatronDeployment

pytestmark = pytest.mark.engines

WORLD = 4


@pytest.fixture(scope="module")
def dep(ray_address: str):
    deployment = MegatronDeployment.start(WORLD, "ws-megatron-test")
    yield deployment
    deployment.close()


def test_dense_tp2_pp2_sync_step_and_scrambled_control(dep: MegatronDeployment, ray_address: str) -> None:
    built = dep.build(load_model_config("tiny-llama"), "tp=2,pp=2", dst="tp=2")  # GQA nh8 nkv2
    assert built[0]["layout"] == "megatron"
    coords = sorted((b["coord"].pp_rank, b["coord"].tp_rank) for b in built)
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    before = dep.sync_and_verify("v1", ray_address)

    # One real optimizer step (loss + backward through the hand-driven pipeline, Adam), then a
    # second sync: destinations hold the new weights, which differ from the old ones.
    losses = ray.get([h.step.remote("v2") for h in dep.trainers])
    assert any(loss is not None and loss > 0 for loss in losses)
    after = dep.sync_and_verify("v2", ray_address)
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    assert len(changed) == len(after), sorted(set(after) - set(changed))
    assert dep.verify(before, "v2")  # the old weights are no longer what they hold

    # Negative control: one scrambled source weight must fail the bit-exact check.
    ray.get(dep.trainers[3].scramble.remote("decoder.layers.1.mlp.linear_fc2.weight"))
    assert dep.sync("v3", ray_address).result is SyncResult.SUCCEEDED
    problems = dep.verify(after, "v3")
    assert problems and all("differ from the reference" in p for p in problems), problems


def test_dense_trainer_at_megatrons_default_expert_tp_syncs(
    dep: MegatronDeployment, ray_address: str
) -> None:
    """A trainer that leaves expert_tensor_parallel_size to Megatron gets etp = TP, dense model or
    not; the WeightSync declares the TP and DP it knows, no expert sizes (etp 1)."""
    built = dep.build(load_model_config("tiny-llama"), "tp=2,dp=2", dst="tp=1", default_etp=True)
    assert sorted(b["coord"].etp_rank for b in built) == [0, 0, 1, 1]  # Megatron's own coordinates
    dep.setup = dataclasses.replace(dep.setup, src=ParallelSpec.parse("tp=2,dp=2"))  # what the user declares
    assert dep.setup.src.etp == 1
    dep.sync_and_verify("v1", ray_address)


def test_vpp_chunks_carry_our_chunk_prefix(dep: MegatronDeployment, ray_address: str) -> None:
    # PP2 x VPP2 (DP2): stage 0 holds blocks 0 and 2 (global layers 0 and 2), checked against
    # Megatron's layer_number by the engine; names get our chunk{c}. prefix.
    built = dep.build(load_model_config("tiny-llama"), "pp=2,vpp=2", dst="tp=2")
    assert built[0]["spec"].vpp == 2
    dep.sync_and_verify("v1", ray_address)


def test_moe_ep2_with_tp2(dep: MegatronDeployment, ray_address: str) -> None:
    built = dep.build(load_model_config("tiny-qwen3-moe"), "tp=2,ep=2", dst="tp=2,ep=2")
    assert {b["coord"].ep_rank for b in built} == {0, 1} and built[0]["spec"].dp == 2
    before = dep.sync_and_verify("v1", ray_address)
    # After a step the TP copies of q/k_layernorm must still agree (Megatron sums their grads
    # over TP); a source whose replicas drift would give destinations mixed weights.
    ray.get([h.step.remote("v2") for h in dep.trainers])
    after = dep.sync_and_verify("v2", ray_address)
    assert not torch.equal(
        after["model.layers.0.self_attn.q_norm.weight"], before["model.layers.0.self_attn.q_norm.weight"]
    )


def test_mla_bf16_keeps_per_tensor_dtypes(dep: MegatronDeployment, ray_address: str) -> None:
    # params_dtype=bf16 without Float16Module: RMSNorm weights stay fp32, expert_bias is an fp32
    # buffer, everything else bf16. Each travels in its own dtype; the manifest says so.
    built = dep.build(load_model_config("tiny-deepseek-v3"), "tp=2", dst="tp=2", dtype="bfloat16")
    dtypes = built[0]["model_config"][TENSOR_DTYPES_KEY]
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert dtypes["model.layers.1.self_attn.kv_a_layernorm.weight"] == "float32"
    assert dtypes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == "bfloat16"
    reference = dep.sync_and_verify("v1", ray_address)
    assert reference["model.norm.weight"].dtype == torch.float32


def test_destinations_holding_other_dtypes_cast_on_receipt(dep: MegatronDeployment, ray_address: str) -> None:
    # fp32 Megatron source; destinations hold the final norm in bf16 (narrowing) and one
    # projection in fp16. The wire carries fp32, each destination rank casts once on receipt:
    # its bits equal the source's `.to(dtype)` (docs/dtypes.md).
    casts = {"model.norm.weight": "bfloat16", "model.layers.1.self_attn.o_proj.weight": "float16"}
    dep.build(load_model_config("tiny-llama"), "tp=2", dst="tp=2", dst_dtypes=casts)
    ray.get([h.randomize_norms.remote(5) for h in dep.trainers])  # norms of 1.0 would cast exactly
    reference = dep.reference()
    assert all(reference[n].dtype == torch.float32 for n in casts)
    report = dep.sync("v1", ray_address)
    assert report.result is SyncResult.SUCCEEDED, report.model_dump_json()
    cast = {**reference, **{n: reference[n].to(getattr(torch, d)) for n, d in casts.items()}}
    assert dep.verify(cast, "v1") == []
    # Negative control: the uncast reference (or a reinterpretation of its bytes) is not what they hold.
    problems = dep.verify(reference, "v1")
    assert problems and all("differ from the reference" in p for p in problems), problems


def test_an_int_destination_for_a_float_tensor_is_refused_before_any_byte(
    dep: MegatronDeployment, ray_address: str
) -> None:
    dep.build(load_model_config("tiny-llama"), "tp=2", dst="tp=2", dst_dtypes={"model.norm.weight": "int32"})
    report = dep.sync("v1", ray_address)
    assert report.result is SyncResult.FAILED and report.moved_bytes == 0
    assert report.failure is not None and report.failure.step == "discover"
    msg = report.failure.message
    assert "tensor model.norm.weight has dtype int32, manifest says float32: no cast is defined" in msg
    assert "rank replica=0,pp=0,tp=" in msg


def test_forward_equivalence_with_transformers(dep: MegatronDeployment) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = {**load_model_config("tiny-qwen3"), "rope_theta": 10000.0}
    dep.build(config, "tp=1", dst="tp=1", init_std=0.2)  # large init: attention is not flat
    ray.get([h.randomize_norms.remote(3) for h in dep.trainers])  # so a norm mix-up would show
    reference = dep.reference()
    hf_config = Qwen3Config(**{**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    hf = Qwen3ForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    tokens = torch.randint(0, config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    ours = ray.get(dep.trainers[0].logits.remote(tokens))

    def diff(state: dict[str, torch.Tensor]) -> tuple[float, float]:
        hf.load_state_dict(state, strict=False)
        with torch.no_grad():
            theirs = hf(input_ids=tokens).logits.float()
        return float((ours - theirs).abs().max()), float(
            (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
        )

    max_diff, agree = diff(reference)
    assert max_diff < 1e-4 and agree == 1.0, (max_diff, agree)
    # Negative control: q rows out of order (a plausible head-grouping bug) must show.
    wrong = dict(reference)
    q = "model.layers.0.self_attn.q_proj.weight"
    wrong[q] = reference[q].flip(0)
    bad_diff, _ = diff(wrong)
    assert bad_diff > 100 * max(max_diff, 1e-6)


def test_bad_setups_refused_naming_the_tensor(dep: MegatronDeployment) -> None:
    config = load_model_config("tiny-llama")  # V=1000: tp=2 pads to 1024
    with pytest.raises(LayoutError, match="vocabulary padded to 1000 rows") as e:
        dep.build(config, "tp=2", dst="tp=2", vocab_size=1000)
    assert _cause(e.value).tensor == "embedding.word_embeddings.weight"
    stray = "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias"  # TE-only, no rule knows it
    with pytest.raises(LayoutError, match="no rule of the megatron layout") as e:
        dep.build(config, "tp=2", dst="tp=2", extra_parameter=stray)
    assert _cause(e.value).tensor == stray


def _cause(error: BaseException) -> LayoutError:
    """The LayoutError a trainer actor raised (Ray wraps it; the fields live on the cause)."""
    cause = getattr(error, "cause", error)
    assert isinstance(cause, LayoutError)
    return cause
