"""Delta syncs through the coordinator: Ray actors, the commit record's base versions, the report.

A bf16 model large enough that most tensors travel as direct transfers (the ones sent as
deltas). A training step flips the low mantissa bit of ~3% of the source's elements. Trials:
- several delta steps, then the same bytes in full (delta=off): every destination rank's bytes
  are identical (sha256), and differ from the previous step's (the steps changed something);
- a destination whose live bytes changed after its commit: the delta sync fails that rank's
  checksum and is redone in full within the same run, never committing the rebuilt bytes;
- the source killed while it sends deltas: every replica stays on one complete version.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest
import ray
import torch

from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import NullReporter, ReplicaState, SyncReport, SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    destination_participants,
    kill_participants,
    weightsync_spec,
)
from sync_runtime.testing.weights import DemoDestination, DemoSource
from sync_runtime.transfer import EngineHooks

pytestmark = pytest.mark.e2e

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip
NS, CHANGED = "t-delta", 0.03
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StepSource(DemoSource):
    def ws_step(self, step: int, version: str) -> None:
        """An optimizer step at an RL-like rate: ~3% of the elements move by one bf16 ulp."""
        st = self._ws_state()
        for index, (_, t) in enumerate(sorted(st.tensors.items())):
            bits = t.view(torch.int16).reshape(-1)
            mask = np.random.default_rng([step, index]).random(bits.numel()) < CHANGED
            bits[torch.from_numpy(mask)] ^= 1
        st.version = version

    def ws_die_after_packs(self, packs: int) -> None:
        """Exit (no word to the peers) after packing `packs` buckets of the next sync."""
        count = [0]

        def die(_round: int, _bucket: object, _tail: torch.Tensor) -> None:
            count[0] += 1
            if count[0] >= packs:
                os._exit(9)

        self._ws_hooks = EngineHooks(after_pack=die)


class AlterableDestination(DemoDestination):
    def ws_alter_live(self) -> str:
        """Flip one bit of the largest live tensor: the bytes are no longer the committed version."""
        live = self._ws_state().destination.tensors  # type: ignore[union-attr]
        name = max(live, key=lambda n: live[n].numel())
        live[name].view(torch.int16).reshape(-1)[11] ^= 1
        return name


@pytest.fixture(scope="module")
def env(local_ray: str):
    address = local_ray
    setup = DemoSetup.create(MODEL, "tp=1", "tp=1,replicas=2", namespace=NS, seed=5)  # type: ignore[arg-type]
    create_participants(
        setup, src_version="v0", dst_version="stale", max_concurrency=4,
        source_class=lambda c: StepSource, dest_class=lambda c: AlterableDestination,
    )  # fmt: skip
    yield {"address": address, "setup": setup}
    kill_participants(setup)


def _sync(env: dict, version: str, delta: str = "auto") -> SyncReport:
    # Small buckets: several buckets and rounds per sync (the kill trial stops between them).
    transport = Transport(transfer_timeout_seconds=20, connect_timeout_seconds=30, bucket_mb=1,
                          staging_budget_mb=4, delta=delta)  # fmt: skip
    named = dataclasses.replace(env["setup"], model="-")  # spec.model is a preset name; unset below
    spec = weightsync_spec(named, version, address=env["address"], transport=transport)
    spec = spec.model_copy(update={"model": None})  # the source actors report the model config
    coordinator = Coordinator(
        spec, NullReporter(), manifest=env["setup"].manifest, advertise_host="127.0.0.1"
    )
    try:
        return coordinator.sync(version)
    finally:
        coordinator.close()


def _source(env: dict):
    return find_actors(NS, env["setup"].src_prefix)[0][1]


def _digests(env: dict) -> list[dict[str, str]]:
    return ray.get([p.handle.ws_sha256.remote() for p in destination_participants(env["setup"])])


def _ok(report: SyncReport, version: str) -> None:
    assert report.result is SyncResult.SUCCEEDED, report.failure
    assert {(r.version, r.state) for r in report.replicas} == {(version, ReplicaState.SERVING)}


def test_delta_steps_equal_a_full_sync(env) -> None:
    _ok(first := _sync(env, "v0"), "v0")
    # Nothing to diff against yet (the source keeps no copy): a plain full sync.
    assert first.encoding == "full" and first.wire_bytes == first.full_bytes
    before = _digests(env)
    for k in (1, 2, 3):
        ray.get(_source(env).ws_step.remote(k, f"v{k}"))
        report = _sync(env, f"v{k}")
        _ok(report, f"v{k}")
        assert report.encoding == "delta" and not report.delta_retried
        assert report.changed_fraction is not None and 0.02 < report.changed_fraction < 0.04
        assert report.wire_bytes < 0.1 * report.full_bytes, (report.wire_bytes, report.full_bytes)
    after = _digests(env)
    assert after != before  # the steps changed the destinations
    full = _sync(env, "v3-full", delta="off")
    _ok(full, "v3-full")
    assert full.encoding == "full" and full.wire_bytes == full.full_bytes
    assert _digests(env) == after  # the deltas left exactly what a full sync of the same bytes leaves


def test_altered_live_base_is_repaired_in_full_within_the_run(env) -> None:
    _ok(_sync(env, "a0"), "a0")
    victim = destination_participants(env["setup"])[1]
    ray.get(victim.handle.ws_alter_live.remote())
    ray.get(_source(env).ws_step.remote(7, "a1"))
    report = _sync(env, "a1")
    _ok(report, "a1")
    assert report.delta_retried and report.encoding == "full"  # the retry went in full
    reference = _sync(env, "a1-full", delta="off")
    _ok(reference, "a1-full")
    digests = _digests(env)
    assert digests[0] == digests[1]  # both replicas hold the same bytes: the altered one repaired


def test_source_killed_mid_delta_leaves_every_replica_on_one_version(env) -> None:
    _ok(_sync(env, "k0"), "k0")
    before = _digests(env)
    source = _source(env)
    ray.get(source.ws_step.remote(9, "k1"))
    ray.get(source.ws_die_after_packs.remote(3))
    report = _sync(env, "k1")
    assert report.result is SyncResult.FAILED
    assert {(r.version, r.state) for r in report.replicas} == {("k0", ReplicaState.SERVING)}, report.replicas
    assert _digests(env) == before  # nothing of k1 was applied anywhere
