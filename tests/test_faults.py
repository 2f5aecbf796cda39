"""Fault tests: a source that raises, a corrupted message (checksum mismatch), a destination that
hangs past the timeout, a destination killed mid-transfer. Each sync must fail with the right
reason, rank and step within the configured timeout (+ margin), nothing may hang, and every
surviving destination must keep its previous weights and version. After each failure the next
sync reconnects (the group that saw the failure is never reused) and succeeds.

One deployment serves the module; faults are armed per test through `ws_arm` of participant
subclasses (`sync_runtime.testing.faults.FaultArming`): it sets the engine observer (`EngineHooks`) the
participant's next `ws_run` passes to the engine.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import ray

from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.errors import Reason
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import NullReporter, SyncResult, SyncStep
from sync_runtime.testing import faults
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    destination_name,
    kill_participants,
    train_step,
    verify_destinations,
    weightsync_spec,
)
from sync_runtime.testing.faults import FaultArming
from sync_runtime.testing.weights import DemoDestination, DemoSource

pytestmark = pytest.mark.e2e

TIMEOUT_S = 4
MARGIN_S = 8.0
"""Allowed on top of the timeout: the coordinator's own margin plus Ray scheduling on 2 cores."""

# Test-defined actor classes travel by value: workers cannot import the test modules by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(faults)


class FaultySource(FaultArming, DemoSource):
    pass


class FaultyDestination(FaultArming, DemoDestination):
    def ws_pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def deployment(local_ray: str):
    address = local_ray
    setup = DemoSetup.create("tiny-llama", "tp=2", "tp=1,replicas=2", namespace="t-faults", seed=3)
    create_participants(
        setup,
        src_version="v1",
        dst_version="v0",
        source_class=lambda c: FaultySource,
        dest_class=lambda c: FaultyDestination,
    )
    spec = weightsync_spec(
        setup,
        "v1",
        address=address,
        transport=Transport(transfer_timeout_seconds=TIMEOUT_S, connect_timeout_seconds=30),
    )
    coordinator = Coordinator(spec, NullReporter(), manifest=setup.manifest)
    report = coordinator.sync("v1")  # a good sync first: failures below must keep v1
    assert report.result is SyncResult.SUCCEEDED, report.failure
    yield setup, coordinator
    coordinator.close()
    kill_participants(setup)


def _handles(setup: DemoSetup, role: Role):
    prefix = setup.src_prefix + "src-" if role is Role.SOURCE else setup.dst_prefix
    return [
        ray.get_actor(n["name"], namespace=setup.namespace)
        for n in sorted(ray.util.list_named_actors(all_namespaces=True), key=lambda a: a["name"])
        if n["namespace"] == setup.namespace and n["name"].startswith(prefix)
    ]


def _dest_state(setup: DemoSetup, alive_only: bool = False):
    out = {}
    for h in _handles(setup, Role.DESTINATION):
        try:
            out[h] = (
                ray.get(h.ws_version.remote(), timeout=30),
                ray.get(h.ws_checksums.remote(), timeout=30),
            )
        except ray.exceptions.RayActorError:
            if not alive_only:
                raise
    return out


def _fail_and_check(setup, coordinator, version: str, *, reason: Reason, rank: int | None, step: SyncStep):
    before = _dest_state(setup)
    train_step(setup, version)
    started = time.monotonic()
    report = coordinator.sync(version)
    elapsed = time.monotonic() - started
    assert report.result is SyncResult.FAILED
    assert report.failure is not None, report
    assert report.failure.reason == reason, report.failure
    assert report.failure.step is step, report.failure
    assert "Traceback" not in report.failure.message, report.failure
    if rank is not None:
        assert report.failure.rank == rank, report.failure
    assert elapsed < TIMEOUT_S + MARGIN_S, f"failure took {elapsed:.1f}s"
    after = _dest_state(setup, alive_only=True)
    for h, state in after.items():
        assert state == before[h], "a surviving destination lost its previous weights or version"
    return report


def _recover(setup, coordinator, version: str) -> None:
    for h in _handles(setup, Role.SOURCE) + _handles(setup, Role.DESTINATION):
        ray.get(h.ws_arm.remote(None))
    report = coordinator.sync(version)
    assert report.result is SyncResult.SUCCEEDED, report.failure
    assert not report.plan_cached or report.stages.connect > 0  # a failed group is never reused
    assert verify_destinations(setup, version) == []


def test_source_raises(deployment):
    setup, coordinator = deployment
    ray.get(_handles(setup, Role.SOURCE)[1].ws_arm.remote("raise"))
    report = _fail_and_check(
        setup, coordinator, "v2", reason=Reason.SOURCE_ERROR, rank=1, step=SyncStep.TRANSFER
    )
    assert "RuntimeError: injected trainer failure before round 0" in report.failure.message
    _recover(setup, coordinator, "v2")


def test_checksum_mismatch(deployment):
    setup, coordinator = deployment
    for h in _handles(setup, Role.SOURCE):
        ray.get(h.ws_arm.remote("corrupt"))
    report = _fail_and_check(
        setup, coordinator, "v3", reason=Reason.CHECKSUM_MISMATCH, rank=None, step=SyncStep.VERIFY
    )
    assert report.failure.rank in (2, 3)  # a destination rank detects it
    assert report.failure.peer in (0, 1)  # ... in what a source rank sent
    assert report.failure.tensor, report.failure  # named: the first tensor of the bad bucket
    _recover(setup, coordinator, "v3")


def test_timeout_of_a_hung_destination(deployment):
    setup, coordinator = deployment
    hung = _handles(setup, Role.DESTINATION)[0]
    ray.get(hung.ws_arm.remote("sleep", TIMEOUT_S * 3))
    report = _fail_and_check(
        setup, coordinator, "v4", reason=Reason.TRANSFER_TIMEOUT, rank=2, step=SyncStep.TRANSFER
    )
    assert destination_name(setup.dst_prefix, RankCoord(role=Role.DESTINATION)) in report.failure.message
    _recover(setup, coordinator, "v4")


def test_destination_killed_mid_transfer(deployment):
    setup, coordinator = deployment
    victim = _handles(setup, Role.DESTINATION)[1]
    ray.get(victim.ws_arm.remote("sleep", 30.0))  # parks it inside round 0 of the next transfer
    killer = threading.Timer(2.0, lambda: ray.kill(victim, no_restart=True))
    killer.start()
    try:
        report = _fail_and_check(
            setup, coordinator, "v5", reason=Reason.PARTICIPANT_DIED, rank=3, step=SyncStep.TRANSFER
        )
    finally:
        killer.join()
    assert "the participant died" in report.failure.message
    survivors = _dest_state(setup, alive_only=True)
    assert len(survivors) == 1 and next(iter(survivors.values()))[0] == "v4"
