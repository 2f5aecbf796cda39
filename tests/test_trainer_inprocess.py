"""The trainer's push in-process (`sync_runtime.trainer.InProcessSync`) with the demo's Ray actors:
push v1, a training step through the sources' `ws_update`, push v2, every destination holds the
new weights bit-exact; a failing sync raises its typed WeightSyncError."""

from __future__ import annotations

import pytest
import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.errors import Reason, SyncStep, TopologyMismatchError, WeightSyncError
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    kill_participants,
    verify_destinations,
    weightsync_spec,
)
from sync_runtime.testing.weights import bits_to_torch, shard_arrays
from sync_runtime.trainer import InProcessSync, push

pytestmark = pytest.mark.e2e

TRANSPORT = Transport(transfer_timeout_seconds=60, connect_timeout_seconds=60)


@pytest.fixture(scope="module")
def deployed(local_ray: str):
    address = local_ray
    setup = DemoSetup.create("tiny-llama", "tp=2", "tp=2,replicas=2", namespace="trainer-push", seed=5)
    create_participants(setup, src_version="v1", dst_version="v0")
    yield setup, address
    kill_participants(setup)


def train_step(setup: DemoSetup, version: str) -> None:
    """New weights written into each source actor's live tensors by its own ws_update."""
    actors = [h for _, h in find_actors(setup.namespace, setup.src_prefix)]
    metas = ray.get([h.ws_meta.remote() for h in actors])
    calls = []
    for handle, meta in zip(actors, metas, strict=True):
        arrays = shard_arrays(setup.manifest, "megatron", setup.src, meta.coord, setup.seed, version)
        calls.append(handle.ws_update.remote({n: bits_to_torch(a) for n, a in arrays.items()}, version))
    ray.get(calls)


def test_push_v1_train_push_v2_destinations_hold_the_new_weights(deployed) -> None:
    setup, address = deployed
    with InProcessSync(weightsync_spec(setup, "v1", address=address, transport=TRANSPORT)) as sync:
        first = push("v1", sync)
        assert first.version == "v1" and first.result is SyncResult.SUCCEEDED and first.moved_bytes > 0
        assert verify_destinations(setup, "v1") == []
        train_step(setup, "v2")
        second = sync.push("v2")
        assert second.version == "v2" and second.result is SyncResult.SUCCEEDED
        assert second.plan_cached  # the same coordinator: plan and process group reused
        assert second.moved_bytes == first.moved_bytes
        assert sync.last_report is second
    assert verify_destinations(setup, "v2") == []


def test_failing_sync_raises_the_typed_error_of_its_report(deployed) -> None:
    """Declared destinations tp=4 do not match the tp=2 actors: TopologyMismatch at discovery."""
    setup, address = deployed
    spec = weightsync_spec(
        setup, "v3", address=address, transport=TRANSPORT, dst=ParallelSpec.parse("tp=4,replicas=1")
    )
    with InProcessSync(spec) as sync, pytest.raises(WeightSyncError) as caught:
        sync.push("v3")
    err = caught.value
    assert isinstance(err, TopologyMismatchError)
    assert err.reason is Reason.TOPOLOGY_MISMATCH and err.step is SyncStep.DISCOVER
    report = sync.last_report
    assert report is not None and report.result is SyncResult.FAILED and report.version == "v3"
    assert report.failure is not None and report.failure.reason == Reason.TOPOLOGY_MISMATCH.value
    assert verify_destinations(setup, "v2") == []  # nothing moved
