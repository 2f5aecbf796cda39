"""Real vLLM destination, DeepSeek-V3 (MLA, noaux_tc router, shared experts) at TP 2.

After a sync the engine must be indistinguishable from one that loaded the checkpoint:
- every tensor its kernels read, the ones vLLM derives at load time (MLA `W_UV`, `W_UK_T`, the
  CPU-packed GEMM and MoE weights) included, has the reference engine's checksum (negative
  control: the dummy-weight engine's differ);
- greedy generation is bit-identical to the reference's, token ids and every logprob (negative
  control: the dummy weights generate otherwise). Each prompt is generated alone: vLLM's CPU MLA
  kernels are not batch-invariant and which requests share a step depends on timing, so batched
  calls of one engine differ from each other; alone they repeat exactly (asserted).
- every rank's committed bytes equal the layout's shard of the seeded v1 weights (negative
  control: the v0 weights' checksums differ), and the derived tensors are never synced.

The engine is the session's shared one (tests/engines/conftest.py `deepseek_tp2`, also synced by
test_vllm_megatron_moe_mla.py): its dummy generation and kernel checksums were recorded when it
started, before any sync; each test here that needs this module's v1 syncs it first. It is a
user's engine through the weightsync plugin, as users run it: `UserEngine`
(sync_runtime/testing/vllm_user_engines.py), a plain Ray actor holding a `vllm.LLM` with
`weight_transfer_config={"backend": "weightsync"}`, attached with `ActorControl`. Its
`VllmEngineRanks` proxy answers `ws_meta`, the kernel state and the applied bytes; the user's
actor generates and reports vLLM's weight version (so does the proxy, through the same engine).
The oracle is the same vLLM configuration loaded normally from the checkpoint (a `VllmReplica`,
through the reference cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.weights import bits_to_torch, shard_arrays
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from tests.support.vllm_deploy import (
    deploy,
    destination_ref,
    generations,
    kernel_checksums,
    rows_equal,
    sync_spec,
)

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-deepseek"
DST = ParallelSpec.parse("tp=2")


@pytest.fixture(scope="module")
def deployment(deepseek_tp2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The demo's sources at v1 and the session's shared DeepSeek-V3 TP 2 engine (dummy weights
    when started; another module's weights if it synced first: the module's first sync, in
    `synced`, overwrites every tensor)."""
    shared = deepseek_tp2
    with deploy(
        "deepseek_v3",
        tmp_path_factory.mktemp("dsv3") / "v1",
        src="tp=2",
        dst=DST,
        namespace=NS,
        engines={},
        references={"ref": ("ds-ref", {"tp": 2})},
        reference_calls=3,
    ) as d:
        dst = [destination_ref("ds", shared.namespace, shared.prefix, DST)]
        yield {
            "setup": d.setup,
            "engine": shared.handle,  # the user's actor: generation, weight version
            "proxy": shared.proxy,  # its attached proxy: ws_meta, kernel state, applied bytes
            "dummy": shared.dummy,
            "dummy_kernels": shared.dummy_kernels,
            "ref": [c["ref"] for c in d.reference_calls],
            "ref_kernels": d.reference_kernels["ref"],
            "spec": sync_spec(d.setup.model, NS, d.setup.src, dst, "v1"),
            "manifest": d.manifest,
            "synced": False,
        }


def _sync(deployment: dict[str, Any]) -> None:
    """This module's sources' v1 into the engine (once per module: the tests after the first
    find it synced)."""
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        report = coordinator.sync("v1")
    finally:
        coordinator.close()
    assert report.result is SyncResult.SUCCEEDED, report.failure
    deployment["synced"] = True


def test_engine_reports_the_mla_layout(deployment: dict[str, Any]) -> None:
    for meta in ray.get(deployment["proxy"].ws_meta.remote()):
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = get_layout("vllm").shard(deployment["manifest"], DST, meta.coord)
        want = {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}  # the router bias: F32
        assert got == want | {n: (s, "bfloat16") for n, (s, _) in want.items() if n.endswith(BIAS)}
        assert got["model.layers.1.self_attn.fused_qkv_a_proj.weight"] == ((704, 256), "bfloat16")
        # fp32 in vLLM and the checkpoint; reported in the model dtype, its F32 wire staged in fp32
        assert got["model.layers.1.mlp.gate.e_score_correction_bias"] == ((8,), "bfloat16")
        assert not any("W_UV" in n or "W_UK_T" in n for n in got)  # derived, never synced


SYNCED_CALLS = 2
BIAS = "e_score_correction_bias"  # staged and committed in vLLM's fp32 (widened from bf16 exactly)


def test_mla_sync_is_bit_identical_to_the_checkpoint_loaded_engine(deployment: dict[str, Any]) -> None:
    engine, ref, ref_kernels = deployment["engine"], deployment["ref"], deployment["ref_kernels"]
    proxy = deployment["proxy"]
    assert all(r == ref[0] for r in ref)  # one prompt at a time, the reference repeats itself
    dummy, dummy_kernels = deployment["dummy"], deployment["dummy_kernels"]  # before any sync
    assert kernel_checksums(proxy) != ref_kernels  # the sync below has bytes to change
    _sync(deployment)
    synced = [generations([engine])[0] for _ in range(SYNCED_CALLS)]
    kernels = kernel_checksums(proxy)
    derived = [n for n in ref_kernels[0] if n.endswith(("W_UV", "W_UK_T", "_w_uv_packed", "_w_uk_packed"))]
    assert len(derived) == 4  # two layers: vLLM's derived MLA tensors are among those compared
    assert kernels == ref_kernels
    assert all(d[n] != r[n] for d, r in zip(dummy_kernels, ref_kernels, strict=True) for n in derived)
    print("deepseek synced calls vs reference:", [rows_equal(x, ref[0]) for x in synced])
    assert all(x == ref[0] for x in synced)  # token ids and every logprob bit
    assert rows_equal(dummy, ref[0]) == 0  # negative control: dummy weights generate otherwise
    assert ray.get(engine.weight_version.remote()) == "v1"  # vLLM's
    assert ray.get(proxy.weight_version.remote()) == "v1"


def test_mla_commits_the_exact_bytes_of_every_synced_tensor(deployment: dict[str, Any]) -> None:
    proxy = deployment["proxy"]
    if not deployment["synced"]:  # run alone: the engine may hold dummy or another module's weights
        _sync(deployment)
    metas = ray.get(proxy.ws_meta.remote())
    applied = [ray.get(proxy.ws_rank_call.remote(i, "ws_checksums", ())) for i in range(len(metas))]
    for meta, got in zip(metas, applied, strict=True):
        want = shard_arrays(deployment["manifest"], "vllm", DST, meta.coord, deployment["setup"].seed, "v1")
        tensors = {n: bits_to_torch(a) for n, a in want.items()}
        tensors = {n: t.float() if n.endswith(BIAS) else t for n, t in tensors.items()}
        assert got == {n: hex_digest(checksum_tensor(t)) for n, t in tensors.items()}, meta.coord
        other = shard_arrays(deployment["manifest"], "vllm", DST, meta.coord, deployment["setup"].seed, "v0")
        assert got != {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in other.items()}
