"""A real `vllm serve` with the weightsync backend, driven through vLLM's HTTP RL routes while a
client keeps generating.

The server is started as a user would (`VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config
'{"backend": "weightsync"}'`, the plugin loaded from the installed package), TP 1, dummy weights.
WeightSync attaches `VllmEngineRanks(HttpControl(url))`; the sources are the demo's
Megatron-layout actors. Oracle: our `VllmReplica` loaded from the reference checkpoint.
Generation goes through the token-in/token-out route `/inference/v1/generate` (greedy, prompt
token ids, logprobs of the chosen tokens), whose choices carry vLLM's weight version spans.
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
from tests.support.vllm_deploy import deploy, destination_ref, rows_equal, sync_spec
from tests.support.vllm_server import Client, free_port, generate, generations, serve, stop, wait_healthy

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-server"
DST = ParallelSpec.parse("tp=1")


@pytest.fixture(scope="module")
def server(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("qwen3server")
    with deploy(
        "qwen3",
        tmp / "v1",
        src="tp=2",
        dst=DST,
        namespace=NS,
        engines={},
        references={"ref": ("ref-server", {"tp": 1})},
    ) as d:
        port, log = free_port(), tmp / "serve.log"
        url = f"http://127.0.0.1:{port}"
        proc = serve(d.setup.model.rsplit("/", 1)[0], port, log)
        ranks = None
        try:
            wait_healthy(url, proc, log)
            ranks = attach("srv-r0", NS, HttpControl(url), ranks=1, pause="keep")
            ray.get(ranks.ws_num_ranks.remote(), timeout=300)
            dst = [destination_ref("srv", NS, "srv-r", DST)]
            yield {
                "setup": d.setup,
                "url": url,
                "ranks": ranks,
                "ref": d.reference_calls[0]["ref"],
                "spec": sync_spec(d.setup.model, NS, d.setup.src, dst, "v1"),
                "manifest": d.manifest,
            }
        finally:
            if ranks is not None:
                ray.kill(ranks)
            stop(proc)


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
    before = generations(url)
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
