"""Real vLLM destinations, one per family that has no other engine test: Llama with `mlp_bias`,
Mixtral, GLM-4.5 (`glm4_moe`) and Gemma 3 text, each a tiny seeded config (CONFIGS), TP 2.

Per family, one module-scoped deployment: the demo's sources at v1 (Megatron layout; Gemma 3,
which no Megatron-Core layer spec holds, from HF-layout FSDP-style ranks), one vLLM engine
started with dummy weights, and the oracle: the same vLLM configuration loaded normally from the
checkpoint of the same v1 weights (through the reference cache). Asserted per family:
- the tensors the live engine reports (names, per-rank shapes, dtypes) are the vllm layout's;
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

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.hf_source import HfDemoSource
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
        engines={"dut": (f"{key}-r0", {"tp": 2})},
        references={"ref": (f"{key}-ref", {"tp": 2})},
        source_class=(lambda c: HfDemoSource) if family.src_layout == "hf" else None,
    ) as d:
        spec = sync_spec(d.setup.model, ns, d.setup.src, [destination_ref("dut", ns, f"{key}-", DST)], "v1")
        source = spec.source.model_copy(update={"layout": family.src_layout})
        yield {
            "key": key,
            "family": family,
            "setup": d.setup,
            "engine": d.engines["dut"],
            "ref": d.reference_calls[0]["ref"],
            "ref_kernels": d.reference_kernels["ref"],
            "spec": spec.model_copy(update={"source": source}),
            "manifest": d.manifest,
        }


def test_engine_reports_the_layouts_tensors(deployment: dict[str, Any]) -> None:
    metas = ray.get(deployment["engine"].ws_meta.remote())
    assert len(metas) == DST.tp
    for meta in metas:
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = get_layout("vllm").shard(deployment["manifest"], DST, meta.coord)
        want = {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}
        for suffix, dtype in deployment["family"].engine_dtypes:
            held = {n: (s, dtype) for n, (s, _) in want.items() if n.endswith(suffix)}
            assert held and all(want[n][1] != dtype for n in held)  # a real difference, present
            want |= held
        assert got == want, meta.coord


def _differ(got: list[dict[str, str]], want: list[dict[str, str]]) -> set[str]:
    return {n for g, w in zip(got, want, strict=True) for n in w if g.get(n) != w[n]}


def test_sync_is_bit_identical_to_the_checkpoint_loaded_engine(deployment: dict[str, Any]) -> None:
    setup, engine, ref, ref_kernels = (deployment[k] for k in ("setup", "engine", "ref", "ref_kernels"))
    dummy, dummy_kernels = generations([engine])[0], kernel_checksums(engine)
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        assert (report := coordinator.sync("v1")).result is SyncResult.SUCCEEDED, report.failure
        synced, kernels = generations([engine])[0], kernel_checksums(engine)
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        assert (report := coordinator.sync("scrambled")).result is SyncResult.SUCCEEDED, report.failure
        scrambled, scrambled_kernels = generations([engine])[0], kernel_checksums(engine)
        train_step(setup, "v1")  # the reference weights again
        assert (report := coordinator.sync("v1")).result is SyncResult.SUCCEEDED, report.failure
        again, again_kernels = generations([engine])[0], kernel_checksums(engine)
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
