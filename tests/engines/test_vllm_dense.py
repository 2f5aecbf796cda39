"""Real vLLM destinations, dense Qwen3 (tied embeddings), TP 1, two replicas.

Sources: the demo's Megatron-layout actors (tp=2). Destinations: two user's engines through the
weightsync plugin, each a vLLM 0.32 CPU engine started with dummy weights in a `UserEngine` actor
(`vllm.LLM` with `weight_transfer_config={"backend": "weightsync"}`, nothing from WeightSync)
attached with `ActorControl` as replica 0 or 1 (its `VllmEngineRanks` proxy `{prefix}r{k}`): the
session's shared pair (tests/engines/conftest.py `qwen3_pair`, also synced by test_vllm_delta),
whose dummy generations were recorded before any sync. Oracle: the same vLLM loaded normally from
the reference checkpoint (the demo's canonical tensors written as an HF model dir).

The last test kills replica 1's worker mid-transfer (a hook of the pair's test worker extension,
tests/support/vllm_faults.py, armed through `collective_rpc`) and retires the pair (the module
runs after the pair's other users, `RETIRES_SHARED`; one that uses it later still starts another).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec, Role
from sync_runtime.errors import TopologyMismatchError
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import check_side, gather
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from tests.support.vllm_deploy import CONFIGS, deploy, destination_ref, generations, rows_equal, sync_spec
from tests.support.vllm_pair_faults import worker_call

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(600)]
NS = "vllm-dense"
DST = ParallelSpec.parse("tp=1,replicas=2")
RETIRES_SHARED = ("qwen3_pair",)
"""The last test kills a replica of the shared pair: this module runs after its other users."""


@pytest.fixture(scope="module")
def deployment(
    ray_address: str, qwen3_pair: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    with deploy(
        "qwen3",
        tmp_path_factory.mktemp("qwen3") / "v2",
        src="tp=2",
        dst=DST,
        namespace=NS,
        engines={},  # the shared pair (its config is CONFIGS["qwen3"] too)
        references={"ref": ("reference", {"tp": 1})},
        version="v2",  # the oracle holds v2; the sources start at v1 and train a step to v2
    ) as d:
        spec = sync_spec(
            d.setup.model,
            NS,
            d.setup.src,
            [destination_ref("inference", qwen3_pair.namespace, qwen3_pair.prefix, DST)],
            "v1",
            bucket_mb=1,
            staging_budget_mb=2,
        )
        yield {
            "setup": d.setup,
            "replicas": list(qwen3_pair.handles),  # the users' actors: generation, weight version
            "proxies": list(qwen3_pair.proxies),  # their VllmEngineRanks: ws_meta
            "prefix": qwen3_pair.prefix,
            "dummy": qwen3_pair.dummy,
            "ref_v2": d.reference_calls[0]["ref"],
            "spec": spec,
            "manifest": d.manifest,
        }


def test_engine_reports_the_layouts_tensors(deployment: dict[str, Any]) -> None:
    """Names, per-rank shapes and dtypes read from the live engine equal the vllm layout's."""
    metas = ray.get(deployment["proxies"][0].ws_meta.remote())
    assert len(metas) == 1
    got = {t.name: (tuple(t.shape), t.dtype) for t in metas[0].tensors}
    shard = get_layout("vllm").shard(deployment["manifest"], DST, metas[0].coord)
    assert got == {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}
    assert got["model.embed_tokens.weight"] == ((1024, 256), "bfloat16")  # V=1000 padded to 64
    assert "lm_head.weight" not in got  # tied: vLLM's lm_head is embed_tokens.weight


def test_a_tensor_the_engine_does_not_hold_is_refused_before_any_byte(deployment: dict[str, Any]) -> None:
    config = dict(CONFIGS["qwen3"], intermediate_size=384)
    ref = deployment["spec"].destinations[0]
    with pytest.raises(TopologyMismatchError) as e:
        check_side(ref, Role.DESTINATION, gather(ref, timeout_s=60), build_manifest(config))
    msg = str(e.value)
    actor = f"{deployment['prefix']}r0#0"
    assert f"rank replica=0,pp=0,tp=0 (actor {actor}): tensor model.layers.0.mlp.gate_up_proj.weight" in msg
    assert "has shape [1024, 256], manifest says [768, 256]" in msg


def test_sync_then_a_training_step_is_bit_identical_to_the_reference(deployment: dict[str, Any]) -> None:
    setup, replicas = deployment["setup"], deployment["replicas"]
    dummy = deployment["dummy"]  # recorded when the pair started (another module may have synced it)
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        report = coordinator.sync("v1")
        assert report.result is SyncResult.SUCCEEDED, report.failure
        v1 = generations(replicas)
        assert ray.get([h.weight_version.remote() for h in replicas]) == ["v1", "v1"]
        assert ray.get([p.weight_version.remote() for p in deployment["proxies"]]) == ["v1", "v1"]
        train_step(setup, "v2")  # the sources' tensors change
        report = coordinator.sync("v2")
        assert report.result is SyncResult.SUCCEEDED, report.failure
        v2 = generations(replicas)
    finally:
        coordinator.close()
    ref = deployment["ref_v2"]
    assert v2[0] == ref and v2[1] == ref  # token ids and logprobs, bit for bit
    assert rows_equal(dummy[0], ref) == 0  # negative control: the dummy weights generate otherwise
    assert rows_equal(v1[0], ref) == 0  # and so does the previous version
    deployment["v2_gen"] = v2


def test_a_destination_killed_mid_transfer_leaves_the_others_serving(
    deployment: dict[str, Any], shared_engines: Any
) -> None:
    setup, (r0, r1), p0 = deployment["setup"], deployment["replicas"], deployment["proxies"][0]
    before = generations([r0])[0]
    train_step(setup, "v3")
    try:
        worker_call(r1, "wstest_arm_exit", 1)  # replica 1's worker dies after round 0 of its ws_run
        # Replica 1's proxy sees its engine fail (ActorControl.alive: vLLM's executor marks itself
        # failed when a worker dies) and fails its rank at once, well before the transfer deadline.
        spec = deployment["spec"]
        started = time.monotonic()
        coordinator = Coordinator(spec, NullReporter(), manifest=deployment["manifest"])
        try:
            report = coordinator.sync("v3")
        finally:
            coordinator.close()
        seconds = time.monotonic() - started
        assert report.result is not SyncResult.SUCCEEDED and report.failure is not None
        print("killed mid-transfer:", report.failure.reason, report.failure.rank, report.failure.message)
        deadline = spec.transport.transfer_timeout_seconds
        assert seconds < deadline, (
            f"the dead engine was noticed only after {seconds:.0f}s (deadline {deadline}s)"
        )
        assert f"{deployment['prefix']}r1#" in report.failure.message  # the dead replica's rank is named
        assert ray.get(r0.weight_version.remote()) == "v2"
        assert generations([r0])[0] == before == deployment.get("v2_gen", [before])[0]
        assert ray.get(p0.weight_version.remote()) == "v2"
        meta = dataclasses.replace(ray.get(p0.ws_meta.remote())[0])
        assert meta.version == "v2"
        with pytest.raises(ray.exceptions.RayTaskError):  # the fault hit replica 1: its engine is dead
            ray.get(deployment["proxies"][1].ws_meta.remote(), timeout=60)
    finally:
        shared_engines.retire("qwen3_pair")  # replica 1's engine is dead (or armed): nobody reuses it
