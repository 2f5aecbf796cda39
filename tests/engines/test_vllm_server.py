"""A real `vllm serve` with the weightsync backend, driven through vLLM's HTTP RL routes while a
client keeps generating.

The server is started as a user would (`VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config
'{"backend": "weightsync"}'`, the plugin loaded from the installed package), TP 1, dummy weights.
WeightSync attaches `VllmEngineRanks(HttpControl(url))`; the sources are the demo's
Megatron-layout actors. Oracle: our `VllmReplica` loaded from the reference checkpoint.
Generation goes through the token-in/token-out route `/inference/v1/generate` (greedy, prompt
token ids, logprobs of the chosen tokens), whose choices carry vLLM's weight version spans.

The server and its sources are the session's shared ones (tests/engines/conftest.py
`qwen3_server`, also used by test_vllm_server_pause.py and test_vllm_server_faults.py): the
dummy-weight control is its generation recorded before any sync; the scrambled push then the
v1 resync prove the sync whatever weights the server held when this module began.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.vllm_models import PROMPTS
from tests.support.vllm_deploy import destination_ref, rows_equal
from tests.support.vllm_server import Client, generate, generations

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
DST = ParallelSpec.parse("tp=1")


@pytest.fixture(scope="module")
def server(qwen3_server: Any) -> Iterator[dict[str, Any]]:
    """The session's shared server (tests/support/shared_server.py) and this module's own
    WeightSync proxy of it (its pause count is this module's syncs only)."""
    shared = qwen3_server
    ranks = attach("srv-r0", shared.namespace, HttpControl(shared.url), ranks=1, pause="keep")
    try:
        ray.get(ranks.ws_num_ranks.remote(), timeout=300)
        dst = [destination_ref("srv", shared.namespace, "srv-r", DST)]
        yield {
            "setup": shared.setup,
            "url": shared.url,
            "ranks": ranks,
            "ref": shared.ref,
            "dummy": shared.dummy,
            "spec": shared.spec(dst, "v1"),
            "manifest": shared.manifest,
        }
    finally:
        ray.kill(ranks)


def _sync(coordinator: Coordinator, client: Client, version: str) -> Any:
    client.syncing.set()
    try:
        report = coordinator.sync(version)
    finally:
        client.syncing.clear()
    assert report.result is SyncResult.SUCCEEDED, report.failure
    return report


def test_server_reports_its_world_size_and_rl_routes(server: dict[str, Any]) -> None:
    control = HttpControl(server["url"])
    assert control.world_size() == 1
    metas = ray.get(server["ranks"].ws_meta.remote())
    assert [(m.coord.replica, m.coord.tp_rank) for m in metas] == [(0, 0)]


def test_in_flight_syncs_are_bit_identical_and_no_request_fails(server: dict[str, Any]) -> None:
    url, ref, setup = server["url"], server["ref"], server["setup"]
    before = server["dummy"]  # the server's generation before any sync (it is shared)
    client = Client(url)
    client.start()
    coordinator = Coordinator(server["spec"], NullReporter(), manifest=server["manifest"])
    try:
        reports = [_sync(coordinator, client, "v1")]
        synced = generations(url)
        train_step(dataclasses.replace(setup, seed=99), "scrambled")
        reports.append(_sync(coordinator, client, "scrambled"))
        scrambled = generations(url)
        train_step(setup, "v1")
        reports.append(_sync(coordinator, client, "v1-again"))
        again = generations(url)
    finally:
        coordinator.close()
        client.stop.set()
        client.join(120)
    pauses = ray.get(server["ranks"].pause_seconds.remote())
    print(
        f"serving: requests={client.requests} failed={client.failed} during_sync={client.during_sync} "
        f"versions_seen={sorted(client.versions)} pause_seconds={[round(p, 4) for p in pauses]} "
        f"transfer_seconds={[round(r.stages.transfer, 4) for r in reports]} "
        f"commit_seconds={[round(r.stages.commit, 4) for r in reports]}"
    )
    assert synced == ref and again == ref  # token ids and every logprob bit
    assert rows_equal(before, ref) == 0  # negative control: dummy weights
    assert rows_equal(scrambled, ref) == 0  # negative control: a scrambled push
    assert client.failed == 0, client.errors[:3]
    assert client.during_sync > 0
    assert {"v1", "scrambled"} <= client.versions  # outputs tagged by vLLM with the sync's version
    assert HttpControl(url).version() == "v1-again"
    _, versions = generate(url, PROMPTS[0])
    assert versions == ["v1-again"]
    assert len(pauses) == 3 and all(0 < p < 60 for p in pauses)
