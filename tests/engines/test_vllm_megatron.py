"""Real Megatron-Core sources (gloo, Ray actors) synced into a real vLLM engine, dense Qwen3.

Source: four Megatron-Core 0.19.2 trainer ranks, TP2 x PP2, a bf16 model (params_dtype bf16:
RMSNorm weights stay fp32 in Megatron, everything else bf16), tied embeddings, GQA (nh 4, nkv 2)
with q/k norms. Destination: one vLLM 0.32 CPU engine at TP2 started with dummy weights, a user's
engine through the weightsync plugin as users run it (`UserEngine`,
sync_runtime/testing/vllm_user_engines.py: a plain Ray actor holding a `vllm.LLM` with
`weight_transfer_config={"backend": "weightsync"}`, attached with `ActorControl`): the user's
actor generates and reports vLLM's weight version; its `VllmEngineRanks` proxy `mg-r0` is what
discovery finds, and reports the weight version through the same engine. Its norms are bf16, so
discovery hands every vLLM rank a cast map and the rank narrows the fp32 norms on receipt
(docs/dtypes.md). Oracle: the same vLLM configuration loaded normally from the reference
checkpoint (a `VllmReplica`, through the reference cache): the Megatron shards converted to HF
tensors by their own split attributes (engines/megatron_convert.py), fp32 norms included, so
vLLM's loader does its own fp32 -> bf16 copy. Then one real optimizer step on Megatron and a
second sync, against a second reference.

Both references are made before the engines start (vLLM has no way here to reload a checkpoint
into a running engine): the trainers step once, are exported, then rebuilt from the same seed;
the test checks that the rebuilt model and its own step reproduce both references bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from sync_runtime.core.models import TENSOR_DTYPES_KEY
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.megatron_convert import gather_full, to_hf
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import discover_all
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.megatron_actors import build_all, start_trainers
from sync_runtime.testing.megatron_deploy import save_reference
from sync_runtime.testing.vllm_user_engines import attach_user_engines, start_user_engine, wait_started
from tests.support.vllm_deploy import (
    CONFIGS,
    destination_ref,
    generations,
    rows_equal,
    stop_engines_and_proxies,
    sync_spec,
    user_engine_env,
)
from tests.support.vllm_oracle import Oracles, finish_oracles, start_oracles

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-megatron"
SRC, DST = "tp=2,pp=2", ParallelSpec.parse("tp=2")
CONFIG = CONFIGS["qwen3"]
BUILD = {"seed": 0, "dtype": "bfloat16", "init_std": 0.2}  # large init: attention is not flat


def _reference(trainers: list[Any]) -> dict[str, torch.Tensor]:
    return to_hf(gather_full(ray.get([h.export.remote() for h in trainers])), CONFIG)


def _build(trainers: list[Any]) -> list[dict[str, Any]]:
    built = build_all(trainers, CONFIG, SRC, **BUILD)
    ray.get([h.randomize_norms.remote(3) for h in trainers])  # norms of 1.0 would hide a mix-up
    return built


def _model_dir(path: Path, reference: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_reference(reference, path / "model.safetensors")
    return str(path)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def deployment(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    trainers = start_trainers(4, NS, "trainer-")
    handles: list[Any] = []
    proxies: list[Any] = []
    oracles: list[Oracles] = []
    try:
        built = _build(trainers)
        ref1 = _reference(trainers)
        ray.get([h.step.remote("v2") for h in trainers])
        ref2 = _reference(trainers)
        built = _build(trainers)  # back to v1: same seed, fresh Adam
        assert _same(_reference(trainers), ref1)
        root = tmp_path_factory.mktemp("megatron-qwen3")
        dirs = {v: _model_dir(root / v, r) for v, r in (("v1", ref1), ("v2", ref2))}
        # the oracles are started only on a reference-cache miss, one at a time (memory)
        oracle = start_oracles(dirs["v1"], NS, {"v1": ("ref-mg1", {"tp": 2})})
        oracles.append(oracle)
        engine = start_user_engine(dirs["v1"], DST.tp, env=user_engine_env(DST.tp))  # dummy weights
        handles = [engine]
        wait_started([engine], timeout_s=800)
        proxies = attach_user_engines([engine], "mg-", NS, tp=DST.tp, timeout_s=800)
        ref_gen = {"v1": finish_oracles(oracle, timeout_s=800)["v1"]["calls"][0]}
        oracles.append(start_oracles(dirs["v2"], NS, {"v2": ("ref-mg2", {"tp": 2})}))
        spec = sync_spec(dirs["v1"], NS, built[0]["spec"], [destination_ref("mg", NS, "mg-", DST)], "v1")
        yield {
            "trainers": trainers,
            "engine": engine,  # the user's actor: generation, weight version
            "proxy": proxies[0],  # its attached proxy (mg-r0): the destination discovery finds
            "oracle_v2": oracles[1],
            "ref_gen": ref_gen,
            "refs": {"v1": ref1, "v2": ref2},
            "spec": spec,
            "manifest": build_manifest(built[0]["model_config"]),  # the sources' dtypes: the wire's
        }
    finally:
        stop_engines_and_proxies([*handles, *(h for o in oracles for h in o.started.values())], proxies)
        for h in trainers:
            ray.kill(h, no_restart=True)


def test_discovery_casts_megatrons_fp32_norms_into_vllms_bf16(deployment: dict[str, Any]) -> None:
    manifest = deployment["manifest"]
    dtypes = manifest.config[TENSOR_DTYPES_KEY]
    assert dtypes["model.norm.weight"] == "float32" and dtypes["model.embed_tokens.weight"] == "bfloat16"
    _, sides, _ = discover_all(deployment["spec"], manifest, 60)
    norms = {n for n, d in dtypes.items() if d == "float32"}
    assert len(norms) == 1 + 2 * 4  # final norm; per layer input, post-attention, q and k norms
    for p in sides[1].participants:
        assert dict(p.wire_dtypes) == dict.fromkeys(norms, "float32"), p.name


def test_megatron_to_vllm_is_bit_identical_then_a_training_step_resyncs(deployment: dict[str, Any]) -> None:
    engine, trainers = deployment["engine"], deployment["trainers"]
    dummy = generations([engine])[0]
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        report = coordinator.sync("v1")
        assert report.result is SyncResult.SUCCEEDED, report.failure
        v1 = generations([engine])[0]
        ray.get([h.step.remote("v2") for h in trainers])  # a real Adam step on the live shards
        assert _same(_reference(trainers), deployment["refs"]["v2"])  # the step is reproducible
        report = coordinator.sync("v2")
        assert report.result is SyncResult.SUCCEEDED, report.failure
        v2 = generations([engine])[0]
    finally:
        coordinator.close()
    v2_oracle = finish_oracles(deployment["oracle_v2"], timeout_s=800)["v2"]
    ref = {**deployment["ref_gen"], "v2": v2_oracle["calls"][0]}
    assert v1 == ref["v1"]  # token ids and every logprob bit
    assert v2 == ref["v2"]
    assert rows_equal(dummy, ref["v1"]) == 0  # negative control: the dummy weights generate otherwise
    assert rows_equal(v1, ref["v2"]) < len(v1) and ref["v1"] != ref["v2"]  # the step changed the output
    assert ray.get(engine.weight_version.remote()) == "v2"  # vLLM's
    assert ray.get(deployment["proxy"].weight_version.remote()) == "v2"
