"""Fault trials against real `vllm serve` servers with the weightsync backend (two replicas,
TP 1): a server killed during its apply, then restarted on its checkpoint (dummy) weights.

The kill comes right after the commit decision (CommitHooks.after_decision): replica 0 commits,
replica 1's server is gone before its pause. Oracle: `VllmReplica` loaded from the reference
checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.commit import CommitHooks
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, ReplicaState, SyncResult
from tests.support.vllm_deploy import deploy, destination_ref, sync_spec
from tests.support.vllm_server import Client, free_port, generations, serve, stop, wait_healthy

# a restarted server starts in 3-8 minutes on a loaded 2-core machine while the other one serves
pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(1500)]
NS = "vllm-server-faults"
DST = ParallelSpec.parse("tp=1,replicas=2")


class Servers:
    """The replicas' server processes and their WeightSync actors, by replica index."""

    def __init__(self, model_dir: str, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.procs: dict[int, Any] = {}
        self.urls: dict[int, str] = {}
        self.actors: dict[int, Any] = {}
        self.starts = 0

    def start(self, *replicas: int) -> None:
        logs = {}
        for k in replicas:
            port = free_port()
            self.starts += 1
            self.urls[k] = f"http://127.0.0.1:{port}"
            logs[k] = self.logs / f"serve-{k}-{self.starts}.log"
            self.procs[k] = serve(self.model_dir, port, logs[k])
        for k in replicas:
            wait_healthy(self.urls[k], self.procs[k], logs[k])
            # a fresh name per start: the killed actor's name may not be free yet
            name = f"sf-r{k}-{self.starts}"
            self.actors[k] = attach(name, NS, HttpControl(self.urls[k]), replica=k, ranks=1)
        ray.get([self.actors[k].ws_num_ranks.remote() for k in replicas], timeout=300)

    def crash(self, k: int) -> None:
        stop(self.procs[k], kill=True)
        ray.kill(self.actors.pop(k))

    def close(self) -> None:
        for a in self.actors.values():
            ray.kill(a)
        for p in self.procs.values():
            stop(p)


@pytest.fixture(scope="module")
def fleet(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("qwen3serverfaults")
    with deploy(
        "qwen3",
        tmp / "v1",
        src="tp=2",
        dst=DST,
        namespace=NS,
        engines={},
        references={"ref": ("ref-sf", {"tp": 1})},
    ) as d:
        servers = Servers(d.setup.model.rsplit("/", 1)[0], tmp)
        try:
            servers.start(0, 1)
            dst = [destination_ref("srv", NS, "sf-r", DST)]
            yield {
                "servers": servers,
                "ref": d.reference_calls[0]["ref"],
                "spec": sync_spec(d.setup.model, NS, d.setup.src, dst, "v1"),
                "manifest": d.manifest,
            }
        finally:
            servers.close()


def test_killed_during_its_apply_then_restarted(fleet: dict[str, Any]) -> None:
    servers, ref = fleet["servers"], fleet["ref"]
    client = Client(servers.urls[0])  # replica 0's clients must see no error throughout
    client.start()
    hooks = CommitHooks(after_decision=lambda: servers.crash(1))
    coordinator = Coordinator(fleet["spec"], NullReporter(), manifest=fleet["manifest"], commit_hooks=hooks)
    try:
        report = coordinator.sync("v1")
        after_crash = generations(servers.urls[0])
        coordinator.commit_hooks = None
        servers.start(1)  # back on its checkpoint (dummy) weights
        restarted = generations(servers.urls[1])
        again = coordinator.sync("v1-again")
        synced = [generations(servers.urls[k]) for k in (0, 1)]
    finally:
        coordinator.close()
        client.stop.set()
        client.join(120)
    print("crash report:", report.result, report.failure, [r.model_dump() for r in report.replicas])
    assert report.result is not SyncResult.SUCCEEDED and report.failure is not None
    states = {r.replica: r for r in report.replicas}
    assert states[0].state is ReplicaState.SERVING and states[0].version == "v1"
    assert states[1].state is not ReplicaState.SERVING or states[1].version != "v1"
    assert after_crash == ref  # the surviving replica committed and serves v1 exactly
    assert restarted != ref  # the restarted server holds its checkpoint weights, not v1
    assert again.result is SyncResult.SUCCEEDED, again.failure
    assert synced == [ref, ref]
    assert client.failed == 0, client.errors[:3]
    assert client.requests > 0
    assert [HttpControl(servers.urls[k]).version() for k in (0, 1)] == ["v1-again", "v1-again"]
