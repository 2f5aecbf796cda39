"""A real-process sync from a context-parallel source: CP ranks are alternative senders.

Demo source actors (seeded weights, real gloo process group, the coordinator) at tp=2,cp=2,ep=2
of tiny DeepSeek-V3 (MLA, MoE, an F32 router bias, one MTP layer: not sent, the destination
serves none) into two vLLM-layout replicas; every destination rank is checked bit-exact (and, as
the control, found to differ from the next version before it is synced), every CP rank must have
sent bytes.
"""

from __future__ import annotations

import pytest

from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    kill_participants,
    train_step,
    verify_destinations,
    weightsync_spec,
)
from tests.test_coordinator_syncs import Collect

pytestmark = pytest.mark.e2e
SRC = "tp=2,cp=2,ep=2"
MTP = (
    "destination 0 (vllm:tp=2,pp=1,replicas=2): mtp: 1 layer (model.layers.3.*), 838,080 bytes canonical, "
    "not sent: destination does not serve MTP"
)


@pytest.fixture(scope="module")
def address(local_ray: str) -> str:
    return local_ray


def test_cp_source_syncs_bit_exact_with_every_cp_rank_sending(address: str) -> None:
    sources = enumerate_ranks(ParallelSpec.parse(SRC), Role.SOURCE)
    assert [c.cp_rank for c in sources] == [0, 0, 1, 1]  # Megatron's order: tp, then cp
    setup = DemoSetup.create("tiny-deepseek-v3", SRC, "tp=2,replicas=2", namespace="t-cp", seed=7)
    try:
        create_participants(setup, src_version="v1", dst_version="v0")
        spec = weightsync_spec(setup, "v1", address=address, transport=Transport(transfer_timeout_seconds=60))
        coordinator = Coordinator(spec, Collect(), manifest=setup.manifest)
        for version, later in (("v1", "v2"), ("v2", "v3")):
            if version != "v1":
                train_step(setup, version)
            report = coordinator.sync(version)
            assert report.result is SyncResult.SUCCEEDED, report.failure
            assert verify_destinations(setup, version) == []
            assert verify_destinations(setup, later) != []  # control: another version does not pass
            sent = {r.rank: r.send_bytes for r in report.ranks if r.rank < len(sources)}
            assert sorted(sent) == list(range(len(sources))) and all(b > 0 for b in sent.values()), sent
            assert report.moved_bytes == report.planned_bytes > 0
            assert report.not_synced == [MTP]
        coordinator.close()
    finally:
        kill_participants(setup)
