"""Real Megatron-Core MoE (EP 2) and MLA sources synced into real vLLM engines (issue 10 a).

Sources: four Megatron-Core 0.19.2 trainer ranks (gloo, Ray actors, local spec), bf16 params
(RMSNorm weights stay fp32 in Megatron; DeepSeek's router `expert_bias` is an fp32 buffer), one
set of actors rebuilt per case:

- Qwen3-MoE at TP2 x EP2 (DP 2): each EP rank holds 4 of the 8 experts whole, attention is cut
  by TP. The vLLM tiny config with 2 KV heads (with its 1 KV head at Megatron TP2, WeightSync's
  megatron layout refuses the sources: nkv % tp != 0). Destination: vLLM TP2 without expert
  parallel (experts cut by TP; vLLM CPU's EP engine loses a worker when generating, docs/vllm.md).
- DeepSeek-V3 (MLA, noaux_tc router with expert_bias, a shared expert) at TP2 (DP 2) into
  vLLM TP2.

Both destinations are users' engines through the weightsync plugin: a `UserEngine`
(sync_runtime/testing/vllm_user_engines.py, a plain Ray actor holding a `vllm.LLM` with
`weight_transfer_config={"backend": "weightsync"}` and dummy weights, started with `user_engine_env`),
attached with `ActorControl`; its `VllmEngineRanks` proxy answers ws_meta, the kernel state and
the committed bytes while the user's actor generates and reports vLLM's weight version.

Oracle for each: the same vLLM configuration loaded normally (`load_format="auto"`, a
`VllmReplica`, through the reference cache) from the reference checkpoint converted from the
Megatron shards by their own split attributes (engines/megatron_convert.py), fp32 tensors
included, so vLLM's loader does its own casts.
Qwen3-MoE: the oracle generates twice and must repeat itself; the destination generates once on
dummy weights and once after the sync, which must equal the oracle bit for bit (token ids and
every logprob); every tensor its kernels read (the prepacked experts included) must then have the
oracle's checksum, and on dummy weights every expert tensor of each rank must not.
DeepSeek-V3 the same by generation, plus every tensor the kernels read (vLLM's derived
W_UV/W_UK_T included) against the oracle's, and the committed bytes of the fp32 expert bias
against the source's fp32 checksum (a bf16 round trip as negative control). Prompts are
generated one at a time: CPU MLA is not batch-invariant (docs/vllm.md).
Negative control of generation: the destination's first call, on dummy weights, agrees with the
oracle on no row.
Only two engines run at a time. The Qwen3-MoE case starts and stops its own user's engine with
its oracle (not shared with test_vllm_moe.py's `moe-tp`: that one holds the 1-KV-head config,
the only real-engine check of vLLM's replicated KV head); the DeepSeek-V3 destination is the
session's shared dummy-weight engine (tests/engines/conftest.py `deepseek_tp2`, also synced by
test_vllm_deepseek.py), whose dummy generation was recorded before any sync.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.models import TENSOR_DTYPES_KEY
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.megatron_convert import gather_full, to_hf
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.megatron_actors import build_all, start_trainers
from sync_runtime.testing.megatron_deploy import save_reference
from sync_runtime.testing.vllm_deploy import Generation
from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from tests.support.vllm_deploy import (
    CONFIGS,
    destination_ref,
    generations,
    kernel_checksums,
    rows_equal,
    stop_engines_and_proxies,
    stop_replicas,
    sync_spec,
    user_engine_env,
)
from tests.support.vllm_oracle import Oracles, finish_oracles, start_oracles

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-megatron-moe-mla"
DST = ParallelSpec.parse("tp=2")
BUILD = {"seed": 0, "dtype": "bfloat16", "init_std": 0.2}  # large init: attention is not flat
MOE = {**CONFIGS["qwen3_moe"], "num_key_value_heads": 2}
MLA = CONFIGS["deepseek_v3"]


@pytest.fixture(scope="module")
def trainers(ray_address: str) -> Iterator[list[Any]]:
    handles = start_trainers(4, NS, "trainer-")  # process start + `import megatron`: reused
    try:
        yield handles
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)


def _build(trainers: list[Any], config: dict[str, Any], src: str) -> dict[str, Any]:
    """Rebuild every trainer; non-trivial norms (and expert biases); the reference checkpoint."""
    built = build_all(trainers, config, src, **BUILD)
    ray.get([h.randomize_norms.remote(3) for h in trainers])  # norms of 1.0 would hide a mix-up
    biases = ray.get([h.randomize_expert_bias.remote(4) for h in trainers])
    reference = to_hf(gather_full(ray.get([h.export.remote() for h in trainers])), config)
    return {"built": built, "biases": biases, "reference": reference}


def _oracle(
    name: str, directory: Path, config: dict[str, Any], reference: dict[str, torch.Tensor], calls: int
) -> Oracles:
    """The checkpoint's model dir and the oracle engine of it, started in the background (only on
    a reference-cache miss): `finish_oracles` has it generate `calls` times, report its kernel
    checksums and stop."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_reference(reference, directory / "model.safetensors")
    return start_oracles(str(directory), NS, {"ref": (f"ref-{name}", {"tp": 2})}, calls)


@contextlib.contextmanager
def _engines(
    name: str, directory: Path, config: dict[str, Any], reference: dict[str, torch.Tensor], calls: int
) -> Iterator[tuple[Any, Any, list[Generation], list[dict[str, str]]]]:
    """(user's actor, its proxy, the oracle's generations, the oracle's kernel checksums): a
    dummy-weight user's engine at TP 2 through the weightsync plugin (a `UserEngine` started with
    `user_engine_env`, attached with `ActorControl` as replica 0 of destination `{name}-`), started
    together with the oracle engine of the same config (only on a reference-cache miss); the
    oracle generates `calls` times, reports its kernel checksums and is stopped before the body."""
    oracles = _oracle(name, directory, config, reference, calls)
    user = start_user_engine(str(directory), 2, env=user_engine_env(2))
    proxies: list[Any] = []
    try:
        wait_started([user], timeout_s=800)
        proxies = attach_user_engines([user], f"{name}-", NS, tp=2, timeout_s=800)
        oracle = finish_oracles(oracles, timeout_s=800)["ref"]
        yield user, proxies[0], oracle["calls"], oracle["kernels"]
    finally:
        stop_engines_and_proxies([user, *oracles.started.values()], proxies)


def _sync_and_generate(
    engine: Any, spec: Any, manifest: Any, calls: int, dummy: Generation | None = None
) -> tuple[Generation, list[Generation], float]:
    """(dummy generation, the `calls` generations after the sync, sync seconds). `dummy`: the
    engine's generation on dummy weights, recorded before (a shared engine's), else measured now."""
    dummy = generations([engine])[0] if dummy is None else dummy
    coordinator = Coordinator(spec, NullReporter(), manifest=manifest)
    try:
        started = time.monotonic()
        report = coordinator.sync("v1")
        seconds = time.monotonic() - started
    finally:
        coordinator.close()
    assert report.result is SyncResult.SUCCEEDED, report.failure
    return dummy, [generations([engine])[0] for _ in range(calls)], seconds


def _check_layout(engine: Any, manifest: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The engine's ranks report the vllm layout's shard shapes of the sources' manifest (their
    dtypes are the engine's own: bf16 where the sources hold fp32 norms)."""
    metas = ray.get(engine.ws_meta.remote())
    assert len(metas) == 2
    for meta in metas:
        got = {t.name: tuple(t.shape) for t in meta.tensors}
        shard = get_layout("vllm").shard(manifest, DST, meta.coord)
        assert got == {t.name: tuple(t.shape) for t in shard.tensors}, meta.coord
    return {t.name: (tuple(t.shape), t.dtype) for t in metas[0].tensors}


def test_megatron_tp2_mla_deepseek_v3_into_vllm_tp2_is_bit_identical(
    trainers: list[Any], deepseek_tp2: Any, tmp_path: Path
) -> None:
    case = _build(trainers, MLA, "tp=2")
    built = case["built"]
    assert case["biases"] == [1] * 4  # one MoE layer: its expert_bias set on every rank
    manifest = build_manifest(built[0]["model_config"])
    dtypes = built[0]["model_config"][TENSOR_DTYPES_KEY]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert dtypes[bias] == "float32" and dtypes["model.layers.1.self_attn.kv_a_layernorm.weight"] == "float32"
    assert set(case["reference"]) == {t.name for t in manifest.tensors}
    b = case["reference"][bias]
    assert not torch.equal(b, b.bfloat16().float())  # a bf16 round trip of the bias would show
    oracles = _oracle("mla", tmp_path / "mla", MLA, case["reference"], 2)
    try:
        oracle = finish_oracles(oracles, timeout_s=800)["ref"]
    finally:
        stop_replicas(list(oracles.started.values()))
    ref, ref_kernels = oracle["calls"], oracle["kernels"]
    engine = deepseek_tp2.handle  # the session's shared engine (dummy, or another module's v1)
    proxy = deepseek_tp2.proxy  # its attached proxy: ws_meta, kernel state, committed bytes
    layout = _check_layout(proxy, manifest)
    assert layout["model.layers.1.self_attn.fused_qkv_a_proj.weight"] == ((704, 256), "bfloat16")
    assert not any("W_UV" in n or "W_UK_T" in n for n in layout)  # derived, never synced
    print("mla: engine reports", bias, layout[bias])
    assert kernel_checksums(proxy) != ref_kernels  # the sync below has bytes to change
    dst = [destination_ref("mla", deepseek_tp2.namespace, deepseek_tp2.prefix, DST)]
    spec = sync_spec(str(tmp_path / "mla"), NS, built[0]["spec"], dst, "v1")
    dummy, after, seconds = _sync_and_generate(engine, spec, manifest, 2, deepseek_tp2.dummy)
    version = ray.get(engine.weight_version.remote())  # vLLM's
    proxy_version = ray.get(proxy.weight_version.remote())
    kernels = kernel_checksums(proxy)
    applied = [ray.get(proxy.ws_rank_call.remote(i, "ws_checksums", ()))[bias] for i in range(2)]
    print(f"mla: sync {seconds:.2f}s; rows equal to the oracle: {[rows_equal(x, ref[0]) for x in after]}")
    assert ref[0] == ref[1]  # one prompt at a time, CPU MLA repeats itself
    assert all(x == ref[0] for x in after)  # token ids and every logprob bit
    assert kernels == ref_kernels  # derived W_UV / W_UK_T and packed weights included
    assert sum(n.endswith(("W_UV", "W_UK_T", "_w_uv_packed", "_w_uk_packed")) for n in kernels[0]) == 4
    # The bias only picks experts, so a narrowed copy could still generate the same: check the
    # committed bytes (fp32, replicated on both ranks) against the source's, and a bf16 round
    # trip of them (what a narrowing wire would have left) as the negative control.
    assert applied == [hex_digest(checksum_tensor(b))] * 2
    assert applied[0] != hex_digest(checksum_tensor(b.bfloat16().float()))
    assert all(rows_equal(dummy, r) == 0 for r in ref)  # negative control: dummy weights differ
    assert version == "v1" and proxy_version == "v1"


def test_megatron_tp2_ep2_qwen3_moe_into_vllm_tp2_is_bit_identical(
    trainers: list[Any], tmp_path: Path
) -> None:
    case = _build(trainers, MOE, "tp=2,ep=2")
    built = case["built"]
    # Megatron puts EP over the TP ranks here (etp 1): tp rank r holds experts [4r, 4r + 4)
    assert {(b["coord"].tp_rank, b["coord"].ep_rank) for b in built} == {(0, 0), (1, 1)}
    assert built[0]["spec"].dp == 2 and built[0]["spec"].ep == 2
    manifest = build_manifest(built[0]["model_config"])
    dtypes = built[0]["model_config"][TENSOR_DTYPES_KEY]
    assert dtypes["model.layers.1.self_attn.q_norm.weight"] == "float32"
    assert dtypes["model.layers.1.mlp.experts.7.down_proj.weight"] == "bfloat16"
    assert set(case["reference"]) == {t.name for t in manifest.tensors}  # the converter covers all
    with _engines("moe", tmp_path / "moe", MOE, case["reference"], 2) as (engine, proxy, ref, ref_kernels):
        layout = _check_layout(proxy, manifest)
        # experts cut by TP on the vLLM side, whole on each Megatron EP rank
        assert layout["model.layers.1.mlp.experts.routed_experts.w13_weight"][0] == (8, 128, 256)
        dummy_kernels = kernel_checksums(proxy)
        spec = sync_spec(
            str(tmp_path / "moe"), NS, built[0]["spec"], [destination_ref("moe", NS, "moe-", DST)], "v1"
        )
        dummy, (synced,), seconds = _sync_and_generate(engine, spec, manifest, 1)
        version = ray.get(engine.weight_version.remote())  # vLLM's
        proxy_version = ray.get(proxy.weight_version.remote())
        kernels = kernel_checksums(proxy)
    print(f"moe: sync {seconds:.2f}s; oracle repeat rows equal: {rows_equal(ref[0], ref[1])}/4")
    assert ref[0] == ref[1]  # Qwen3-MoE on CPU repeats itself exactly
    assert synced == ref[1]  # token ids and every logprob bit
    assert rows_equal(dummy, ref[1]) == 0  # negative control: the dummy weights generate otherwise
    assert kernels == ref_kernels  # every tensor the kernels read, the prepacked experts included
    for got, want in zip(dummy_kernels, ref_kernels, strict=True):  # negative control: per rank
        experts = [n for n in want if n.endswith(("w13_weight", "w2_weight"))]
        assert experts and all(got[n] != want[n] for n in experts)
    assert version == "v1" and proxy_version == "v1"
