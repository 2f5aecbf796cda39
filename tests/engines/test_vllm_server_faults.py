"""Fault trials against real `vllm serve` servers with the weightsync backend (two replicas,
TP 1): a server killed during its apply, then replaced by a fresh server on its checkpoint
(dummy) weights that the next sync repairs.

The kill comes right after the commit decision (CommitHooks.after_decision): replica 0 commits,
replica 1's server is gone before its pause. Oracle: `VllmReplica` loaded from the reference
checkpoint. Replica 0, which is never killed, is the session's shared server and sources
(tests/engines/conftest.py `qwen3_server`); replica 1 and its replacement are this module's.

The replacement server process is launched with the fleet and joins the deployment (its
WeightSync actor is created, so discovery sees it) only after the crash: to WeightSync that is a
restarted replica. Launched only after the crash, it took 3-8 minutes to boot on a loaded 2-core
machine while replica 0 kept serving (three vLLM processes importing torch against a serving
engine's OpenMP threads), which made this the slowest test of the suite.
"""

from __future__ import annotations

import time
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
from sync_runtime.testing.vllm_models import PROMPTS
from tests.support import shared_server
from tests.support.vllm_deploy import destination_ref
from tests.support.vllm_server import Client, Server, generate, generations, launch, stop

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(1200)]
NS = shared_server.NS
DST = ParallelSpec.parse("tp=1,replicas=2")


class Servers:
    """The replicas' server processes and their WeightSync actors, by replica index."""

    def __init__(self, model_dir: str, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.servers: dict[int, Server] = {}
        self.actors: dict[int, Any] = {}
        self.launched: list[Server] = []
        self.joins = 0

    def launch(self) -> Server:
        """A server process of this module, booting in the background (not yet a replica)."""
        server = launch(self.model_dir, self.logs / f"serve-{len(self.launched)}.log")
        self.launched.append(server)
        return server

    def join(self, k: int, server: Server) -> None:
        """`server` becomes replica k: healthy, then its WeightSync actor (found by discovery)."""
        server.wait()
        self.servers[k] = server
        self.joins += 1  # a fresh name per server: the killed actor's name may not be free yet
        self.actors[k] = attach(f"sf-r{k}-{self.joins}", NS, HttpControl(server.url), replica=k, ranks=1)
        ray.get(self.actors[k].ws_num_ranks.remote(), timeout=300)

    def url(self, k: int) -> str:
        return self.servers[k].url

    def crash(self, k: int) -> None:
        stop(self.servers[k].proc, kill=True)
        ray.kill(self.actors.pop(k))

    def close(self) -> None:
        """Detach every replica; stop every server this module launched (not the shared one)."""
        for a in self.actors.values():
            ray.kill(a)
        for s in self.launched:
            stop(s.proc)


@pytest.fixture(scope="module")
def fleet(qwen3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Replica 0: the session's shared server, first pushed other weights (neither the oracle's
    nor dummy) so that its commit of v1 shows; replica 1 and its replacement: this module's own."""
    shared = qwen3_server
    servers = Servers(shared.setup.model.rsplit("/", 1)[0], tmp_path_factory.mktemp("qwen3serverfaults"))
    try:
        first = servers.launch()  # replica 1, killed by the trial
        replacement = servers.launch()  # replica 1 after the crash
        shared.push_other_weights()  # before replica 0's proxy is attached: one proxy at a time
        assert generations(shared.url) != shared.ref
        servers.join(0, shared.server)
        servers.join(1, first)
        # The replacement's first forward pass, before the trial: a fresh server's first
        # request took 60-120 s beside a serving replica (it is still on its checkpoint).
        generate(replacement.wait(), PROMPTS[0], timeout_s=600)
        dst = [destination_ref("srv", NS, "sf-r", DST)]
        yield {
            "servers": servers,
            "replacement": replacement,
            "ref": shared.ref,
            "spec": shared.spec(dst, "v1"),
            "manifest": shared.manifest,
        }
    finally:
        servers.close()


def test_killed_during_its_apply_then_restarted(fleet: dict[str, Any]) -> None:
    servers, ref = fleet["servers"], fleet["ref"]
    client = Client(servers.url(0))  # replica 0's clients must see no error throughout
    client.start()
    hooks = CommitHooks(after_decision=lambda: servers.crash(1))
    coordinator = Coordinator(fleet["spec"], NullReporter(), manifest=fleet["manifest"], commit_hooks=hooks)
    phases: dict[str, float] = {}
    t0 = time.monotonic()

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - t0 - sum(phases.values()), 1)

    try:
        report = coordinator.sync("v1")
        phase("sync v1 (replica 1 killed)")
        after_crash = generations(servers.url(0))
        coordinator.commit_hooks = None
        servers.join(1, fleet["replacement"])  # a fresh server, on its checkpoint (dummy) weights
        phase("replacement joins")
        restarted = generations(servers.url(1), timeout_s=300)
        phase("replacement generates")
        again = coordinator.sync("v1-again")
        phase("sync v1-again")
        synced = [generations(servers.url(k)) for k in (0, 1)]
        phase("generations")
    finally:
        coordinator.close()
        client.stop.set()
        client.join(120)
    print("server faults phases (s):", phases)
    print("crash report:", report.result, report.failure, [r.model_dump() for r in report.replicas])
    assert report.result is not SyncResult.SUCCEEDED and report.failure is not None
    states = {r.replica: r for r in report.replicas}
    assert states[0].state is ReplicaState.SERVING and states[0].version == "v1"
    assert states[1].state is not ReplicaState.SERVING or states[1].version != "v1"
    assert after_crash == ref  # the surviving replica committed and serves v1 exactly
    assert restarted != ref  # the new server holds its checkpoint (dummy) weights, not v1
    assert again.result is SyncResult.SUCCEEDED, again.failure
    assert synced == [ref, ref]
    assert client.failed == 0, client.errors[:3]
    assert client.requests > 0
    assert [HttpControl(servers.url(k)).version() for k in (0, 1)] == ["v1-again", "v1-again"]
