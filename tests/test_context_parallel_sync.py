"""A real-process sync from a context-parallel source: CP ranks are alternative senders.

Demo source actors (seeded weights, real gloo process group, the coordinator) at tp=2,cp=2,ep=2
of tiny DeepSeek-V3 (MLA, MoE, an F32 router bias, one MTP layer left out) into two vLLM-layout
replicas; every destination rank is checked bit-exact, every CP rank must have sent bytes.
"""

from __future__ import annotations

import pytest

from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from tests.test_coordinator_syncs import run_syncs

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def address(local_ray: str) -> str:
    return local_ray


def test_cp_source_syncs_bit_exact_with_every_cp_rank_sending(address: str) -> None:
    src = "tp=2,cp=2,ep=2"
    reporter, pulled = run_syncs(
        address, "t-cp", "tiny-deepseek-v3", src, "tp=2,replicas=2", versions=("v1", "v2")
    )
    assert pulled
    sources = enumerate_ranks(ParallelSpec.parse(src), Role.SOURCE)
    assert [c.cp_rank for c in sources] == [0, 0, 1, 1]  # Megatron's order: tp, then cp
    for report in reporter.reports:
        sent = {r.rank: r.send_bytes for r in report.ranks if r.rank < len(sources)}
        assert sorted(sent) == list(range(len(sources))) and all(b > 0 for b in sent.values()), sent
        assert report.not_synced == [
            "1 MTP layer(s) (num_nextn_predict_layers=1, model.layers.3.*): not synced"
        ]
