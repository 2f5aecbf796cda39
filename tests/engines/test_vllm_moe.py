"""Real vLLM destinations, Qwen3-MoE at TP 2, without and with expert parallel, in one sync.

Two destination deployments of one WeightSync: `moe-tp` (experts cut by TP: w13 [8, 128, 256]
per rank) and `moe-ep` (EP = TP: whole experts, w13 [4, 256, 256] per rank). Each is a user's
engine through the weightsync plugin, as users run it: `UserEngine`
(sync_runtime/testing/vllm_user_engines.py), a plain Ray actor holding a `vllm.LLM` with
`weight_transfer_config={"backend": "weightsync"}` (`moe-ep`'s with `enable_expert_parallel=True`),
attached with `ActorControl`. Its `VllmEngineRanks` proxy answers `ws_meta`, the kernel state and
the applied bytes; the user's actor generates and reports vLLM's weight version (so does the
proxy, through the same engine). `moe-tp` is compared with the same vLLM configuration loaded
normally from the reference checkpoint (a `VllmReplica`, through the reference cache), by
generation (bit for bit) and by every tensor its kernels read.

`moe-ep` cannot generate on CPU: vLLM 0.32's CPU fused-MoE kernel crashes with expert parallel
(a segfault in csrc/cpu/cpu_fused_moe.cpp in the *checkpoint-loaded* engine's first generate, no
WeightSync code involved). It loads, though: so its oracle is an EP engine loaded from the
checkpoint that never generates, and the synced EP engine must hold exactly its kernel state
(every packed expert weight, norm and attention tensor, by checksum), after the first sync and
after a second one; after a scrambled sync it must not (negative control). The bytes each rank
applied are also checked against the layout's shard of the canonical weights.

The model has a single KV head, which both engines replicate over their TP ranks: the only
real-engine check of the vllm layout's replicated KV heads (tp > nkv). So its engines are its own,
not shared with test_vllm_megatron_moe_mla.py's Qwen3-MoE TP 2 destination, whose config has 2 KV
heads: with 1 at Megatron TP 2, WeightSync's megatron layout refuses its sources (nkv % tp != 0)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
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
NS = "vllm-moe"
TP, EP = ParallelSpec.parse("tp=2"), ParallelSpec.parse("tp=2,ep=2")


@pytest.fixture(scope="module")
def deployment(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with deploy(
        "qwen3_moe",
        tmp_path_factory.mktemp("qwen3moe") / "v1",
        # nkv=1: a Megatron source cannot split it over TP; experts are cut over DP (EP=2) instead
        src="dp=2,ep=2",
        dst=TP,
        namespace=NS,
        engines={},
        references={"tp": ("ref-tp", {"tp": 2})},
        reference_calls=2,  # two generate calls, like the destinations (dummy, then synced)
        silent_references={"ep": ("ref-ep", {"tp": 2, "ep": True})},
        user_engines={"tp": ("moe-tp-", TP.tp), "ep": ("moe-ep-", TP.tp, {"enable_expert_parallel": True})},
    ) as d:
        dsts = [destination_ref("moe-tp", NS, "moe-tp-", TP), destination_ref("moe-ep", NS, "moe-ep-", EP)]
        yield {
            "setup": d.setup,
            "engines": d.users,  # the users' actors: generation, weight version
            "proxies": d.proxies,  # their attached proxies: ws_meta, kernel state, applied bytes
            "ref": d.reference_calls[1],
            "ref_first": d.reference_calls[0],
            "ref_kernels": d.reference_kernels,
            "spec": sync_spec(d.setup.model, NS, d.setup.src, dsts, "v1"),
            "manifest": d.manifest,
        }


def test_engines_report_the_layouts_expert_shards(deployment: dict[str, Any]) -> None:
    for key, spec in (("tp", TP), ("ep", EP)):
        for meta in ray.get(deployment["proxies"][key].ws_meta.remote()):
            got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
            shard = get_layout("vllm").shard(deployment["manifest"], spec, meta.coord)
            assert got == {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}, (key, meta.coord)
            w13 = got["model.layers.1.mlp.experts.routed_experts.w13_weight"][0]
            assert w13 == ((4, 256, 256) if key == "ep" else (8, 128, 256))
            assert meta.coord.ep_rank == (meta.coord.tp_rank if key == "ep" else 0)


def test_sync_is_bit_identical_a_scrambled_push_differs_and_a_resync_restores(
    deployment: dict[str, Any],
) -> None:
    setup, engines, ref = deployment["setup"], deployment["engines"], deployment["ref"]
    proxies = deployment["proxies"]
    order = ["tp"]  # generation only where vLLM's CPU engine can generate (module docstring)
    serving = [engines[k] for k in order]
    assert deployment["ref_first"] == ref  # Qwen3-MoE on CPU repeats itself exactly
    dummy = dict(zip(order, generations(serving), strict=True))
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        report = coordinator.sync("v1")
        assert report.result is SyncResult.SUCCEEDED, report.failure
        synced = dict(zip(order, generations(serving), strict=True))
        kernels = {k: kernel_checksums(h) for k, h in proxies.items()}
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        assert coordinator.sync("scrambled").result is SyncResult.SUCCEEDED
        scrambled = dict(zip(order, generations(serving), strict=True))
        scrambled_kernels = {k: kernel_checksums(h) for k, h in proxies.items()}
        train_step(setup, "v1")  # the reference weights again
        assert coordinator.sync("v1").result is SyncResult.SUCCEEDED
        again = dict(zip(order, generations(serving), strict=True))
        again_kernels = {k: kernel_checksums(h) for k, h in proxies.items()}
        applied = [ray.get(proxies["ep"].ws_rank_call.remote(i, "ws_checksums", ())) for i in range(2)]
        metas = ray.get(proxies["ep"].ws_meta.remote())
    finally:
        coordinator.close()
    for key in order:
        assert synced[key] == ref[key], key  # bit for bit, token ids and logprobs
        assert again[key] == ref[key], key  # the second apply re-packs the experts too
        assert rows_equal(dummy[key], ref[key]) == 0, key
        assert rows_equal(scrambled[key], ref[key]) == 0, key
    ref_kernels = deployment["ref_kernels"]
    for key in ("tp", "ep"):  # every tensor the kernels read, the prepacked experts included
        assert kernels[key] == ref_kernels[key], key
        assert again_kernels[key] == ref_kernels[key], key
        for got, want in zip(scrambled_kernels[key], ref_kernels[key], strict=True):
            experts = [n for n in want if n.endswith(("w13_weight", "w2_weight"))]
            assert experts and all(got[n] != want[n] for n in experts), key
    assert ray.get([h.weight_version.remote() for h in engines.values()]) == ["v1", "v1"]  # vLLM's
    assert ray.get([h.weight_version.remote() for h in proxies.values()]) == ["v1", "v1"]
    for meta, got in zip(metas, applied, strict=True):
        want = shard_arrays(deployment["manifest"], "vllm", EP, meta.coord, 0, "v1")
        assert got == {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in want.items()}
