"""Real vLLM destinations, one per family that has no other engine test: Llama with `mlp_bias`,
Mixtral, GLM-4.5 (`glm4_moe`), Gemma 3 text and gpt-oss, each a tiny seeded config (CONFIGS), TP 2.

Per family, one module-scoped deployment: the demo's sources at v1 (Megatron layout; Gemma 3,
which no Megatron-Core layer spec holds, and gpt-oss from HF-layout FSDP-style ranks: its megatron
layout, from real Megatron-Core ranks, is tests/engines/test_megatron_families.py's), one vLLM engine
started with dummy weights, and the oracle: the same vLLM configuration loaded normally from the
checkpoint of the same v1 weights (through the reference cache).

The destination under test is a user's engine through the weightsync plugin, as users run it:
`UserEngine` (sync_runtime/testing/vllm_user_engines.py), a plain Ray actor holding a `vllm.LLM`
with `weight_transfer_config={"backend": "weightsync"}`, attached with `ActorControl` (its
`VllmEngineRanks` proxy answers `ws_meta` and the kernel state; the user's actor generates and
reports the weight version). Its engine core runs in a process of its own, vLLM's default
(`user_engine_env`: the one process the actor spawns; the core forks the TP workers in the test
session). Asserted per family:
- the tensors the live engine reports (names, per-rank shapes, dtypes) are the vllm layout's
  (gpt-oss's expert weights in the checkpoint's orientation, which its apply permutes as vLLM's
  loader does: `received_permuted`);
- after one sync, greedy generation is bit-identical to the oracle's (token ids and every
  logprob) and every tensor the engine's kernels read has the oracle's checksum;
- negative controls: the dummy-weight engine generates otherwise and its kernel state differs;
  after a sync of other weights (seed 99, same shapes) generation and the synced weights'
  kernel state differ again, and a second sync of v1 restores both exactly.
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
from sync_runtime.engines import vllm_family_load
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.hf_source import HfDemoSource
from sync_runtime.testing.vllm_models import CONFIGS
from tests.support.vllm_deploy import (
    deploy,
    destination_ref,
    generations,
    kernel_checksums,
    rows_equal,
    sync_spec,
)

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
DST = ParallelSpec.parse("tp=2")


@dataclasses.dataclass(frozen=True)
class Family:
    src: str
    src_layout: str = "megatron"
    engine_dtypes: tuple[tuple[str, str], ...] = ()
    """(name suffix, dtype) where the live engine reports another dtype than the layout's wire."""
    received_permuted: tuple[str, ...] = ()
    """Parameters (name in their module) the rank receives in the checkpoint's orientation and the
    apply permutes into vLLM's (engines/vllm_family_load.py), as vLLM's loader does."""


FAMILIES = {
    "llama_mlp_bias": Family("tp=2"),
    "mixtral": Family("tp=2,ep=2"),  # experts whole per EP rank on the source, cut by TP in vLLM
    # vLLM's Glm4MoE holds the router weight in fp32 (the checkpoint's bf16 wire is cast on
    # receipt) and reports the fp32 router bias in the model dtype, as for DeepSeek-V3.
    "glm4_moe": Family(
        "tp=2",
        engine_dtypes=(("mlp.gate.weight", "float32"), ("mlp.gate.e_score_correction_bias", "bfloat16")),
    ),
    "gemma3": Family("tp=2", "hf"),
    # HF-layout tp=2 sources (the HF source path; Megatron's: test_megatron_families.py). vLLM
    # permutes the experts on load: (E, H, 2n) -> w13_weight (E, 2n, H), (E, n, H) -> w2_weight (E, H, n).
    "gpt_oss": Family("tp=2", "hf", received_permuted=("w13_weight", "w2_weight")),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def deployment(
    request: pytest.FixtureRequest, ray_address: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    key: str = request.param
    family, ns = FAMILIES[key], f"vllm-{key.replace('_', '-')}"
    with deploy(
        key,
        tmp_path_factory.mktemp(key) / "v1",
        src=family.src,
        dst=DST,
        namespace=ns,
        engines={},
        references={"ref": (f"{key}-ref", {"tp": 2})},
        source_class=(lambda c: HfDemoSource) if family.src_layout == "hf" else None,
        user_engines={"dut": (f"{key}-", DST.tp)},
    ) as d:
        spec = sync_spec(d.setup.model, ns, d.setup.src, [destination_ref("dut", ns, f"{key}-", DST)], "v1")
        source = spec.source.model_copy(update={"layout": family.src_layout})
        yield {
            "key": key,
            "family": family,
            "setup": d.setup,
            "engine": d.users["dut"],  # the user's actor: generation, weight version
            "proxy": d.proxies["dut"],  # its attached proxy: ws_meta, kernel state
            "ref": d.reference_calls[0]["ref"],
            "ref_kernels": d.reference_kernels["ref"],
            "spec": spec.model_copy(update={"source": source}),
            "manifest": d.manifest,
        }


def test_engine_reports_the_layouts_tensors(deployment: dict[str, Any]) -> None:
    metas = ray.get(deployment["proxy"].ws_meta.remote())
    assert len(metas) == DST.tp
    for meta in metas:
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = get_layout("vllm").shard(deployment["manifest"], DST, meta.coord)
        want = {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}
        for suffix, dtype in deployment["family"].engine_dtypes:
            held = {n: (s, dtype) for n, (s, _) in want.items() if n.endswith(suffix)}
            assert held and all(want[n][1] != dtype for n in held)  # a real difference, present
            want |= held
        _check_received_permuted(deployment["key"], deployment["family"], want)
        assert got == want, meta.coord


def _check_received_permuted(key: str, family: Family, want: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The family's statement is the apply's table, and each such tensor is a real transpose: the
    layout's (checkpoint-oriented) shard shape is not the shape of vLLM's parameter."""
    model_type = CONFIGS[key]["model_type"]
    assert set(family.received_permuted) == set(vllm_family_load.PERMUTED.get(model_type, {}))
    for suffix in family.received_permuted:
        held = [shape for n, (shape, _) in want.items() if n.endswith("." + suffix)]
        assert held
        for shape in held:
            param = tuple(
                vllm_family_load.to_param(model_type, suffix, torch.empty(shape, device="meta")).shape
            )
            assert param != shape
            assert vllm_family_load.received_shape(model_type, suffix, param) == shape


def _differ(got: list[dict[str, str]], want: list[dict[str, str]]) -> set[str]:
    return {n for g, w in zip(got, want, strict=True) for n in w if g.get(n) != w[n]}


def test_sync_is_bit_identical_to_the_checkpoint_loaded_engine(deployment: dict[str, Any]) -> None:
    setup, engine, proxy = (deployment[k] for k in ("setup", "engine", "proxy"))
    ref, ref_kernels = deployment["ref"], deployment["ref_kernels"]
    dummy, dummy_kernels = generations([engine])[0], kernel_checksums(proxy)
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        assert (report := coordinator.sync("v1")).result is SyncResult.SUCCEEDED, report.failure
        synced, kernels = generations([engine])[0], kernel_checksums(proxy)
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        assert (report := coordinator.sync("scrambled")).result is SyncResult.SUCCEEDED, report.failure
        scrambled, scrambled_kernels = generations([engine])[0], kernel_checksums(proxy)
        train_step(setup, "v1")  # the reference weights again
        assert (report := coordinator.sync("v1")).result is SyncResult.SUCCEEDED, report.failure
        again, again_kernels = generations([engine])[0], kernel_checksums(proxy)
    finally:
        coordinator.close()
    key = deployment["key"]
    print(f"{key}: synced rows equal to the reference: {rows_equal(synced, ref)}/{len(ref)}")
    assert synced == ref and again == ref  # token ids and every logprob bit
    assert kernels == ref_kernels and again_kernels == ref_kernels  # every tensor the kernels read
    assert rows_equal(dummy, ref) == 0 and rows_equal(scrambled, ref) == 0  # negative controls
    changed = _differ(scrambled_kernels, ref_kernels)
    assert changed and changed <= _differ(dummy_kernels, ref_kernels)
    assert ray.get(engine.weight_version.remote()) == "v1"
