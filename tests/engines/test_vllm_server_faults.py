"""Fault trials against real `vllm serve` servers with the weightsync backend (two replicas,
TP 1). Replica 0, never killed, is the session's shared server and sources
(tests/engines/conftest.py `qwen3_server`); replica 1 and its replacement are this module's.
Oracle: `VllmReplica` loaded from the reference checkpoint.

1. Killed during its apply, then restarted: the kill comes right after the commit decision
   (CommitHooks.after_decision): replica 0 commits, replica 1's server is gone before its pause.
   The replacement server process is launched with the fleet and joins the deployment (its
   WeightSync actor is created, so discovery sees it) only after the crash: to WeightSync that
   is a restarted replica, back on its checkpoint (dummy) weights, which the next sync repairs.
   Launched only after the crash, it took 3-8 minutes to boot on a loaded 2-core machine while
   replica 0 kept serving (three vLLM processes importing torch against a serving engine's
   OpenMP threads), which made this the slowest test of the suite.
2. Killed during the transfer: the victim is replica 1's server of the moment (the replacement,
   after trial 1: no further engine start). The sources push new weights (seed OTHER_SEED's,
   whose generation on replica 0 the fleet recorded; v1's, the oracle's, when this trial runs
   alone and replica 0 holds the former) in 1 MiB buckets under a 2 MiB staging budget: three
   rounds, each with bytes for replica 1. The sources are parked before round 1
   (sync_runtime/testing/transfer_gate.py); once replica 1's own progress report (in the
   coordinator's store) says its round-0 bucket landed, replica 1's server is SIGKILLed (its
   WeightSync actor stays, as a server pod dies under a running WeightSync) and the gate opens.
   The sync fails in the transfer naming replica 1's rank; replica 0 did not commit: it serves
   its previous version bit for bit (and not the new weights' generation), its clients saw no
   error. A retry with the dead server still a replica fails at discovery naming it; a spec
   selecting replica 0 alone then syncs the new weights, and replica 0's generation becomes
   the recorded one (the positive control of that negative control).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.commit import CommitHooks
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.schema.report import NullReporter, ReplicaState, SyncResult, SyncStep
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.transfer_gate import (
    SourceGate,
    bytes_per_round,
    messages_to,
    replica_rank,
    wait_received,
)
from sync_runtime.testing.vllm_models import PROMPTS
from tests.support import shared_server
from tests.support.vllm_deploy import destination_ref, sync_spec
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

    def kill_server(self, k: int) -> None:
        """SIGKILL to replica k's server process group; its WeightSync actor stays."""
        stop(self.servers[k].proc, kill=True)

    def crash(self, k: int) -> None:
        self.kill_server(k)
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
        other = generations(shared.url)  # the weights of seed OTHER_SEED, as a server generates them
        assert other != shared.ref
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
            "shared": shared,
            "other": other,
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


def test_killed_during_the_transfer_then_synced_without_it(fleet: dict[str, Any], tmp_path: Path) -> None:
    servers, shared = fleet["servers"], fleet["shared"]
    url0 = servers.url(0)
    before_label, before = HttpControl(url0).version(), generations(url0)
    # What WeightSync says replica 0 holds: the label vLLM reports, unless replica 0's rank was
    # set up by this module's proxy after another proxy committed it (trial 2 alone): then ''
    # (unknown: the proxy does not take vLLM's label for a fact about the weights)
    before_version = ray.get(servers.actors[0].ws_rank_call.remote(0, "ws_version", ()), timeout=120)
    # The new weights: of two whose generation is known, the one replica 0 does not hold (seed
    # OTHER_SEED's after trial 1, which left it on v1; v1's when this trial runs alone)
    other_step = (dataclasses.replace(shared.setup, seed=shared_server.OTHER_SEED), "other")
    new_step, new = (
        (other_step, fleet["other"]) if before != fleet["other"] else ((shared.setup, "v1"), fleet["ref"])
    )
    assert before != new  # else a commit of the new weights on replica 0 would not show
    dst = [destination_ref("srv", NS, "sf-r", DST)]
    # 1 MiB buckets, 2 MiB staging budget: three rounds, each with bytes for replica 1 (see below)
    small = {"bucket_mb": 1, "staging_budget_mb": 2, "delta": "off", "transfer_timeout_seconds": 120}
    spec = sync_spec(shared.setup.model, shared.namespace, shared.setup.src, dst, "v2", **small)
    coordinator = Coordinator(spec, NullReporter(), manifest=fleet["manifest"])
    sources = [h for _, h in find_actors(shared.namespace, shared.setup.src_prefix)]
    client = Client(url0)  # replica 0's clients must see no error throughout
    client.start()
    gate, pool = None, ThreadPoolExecutor(1)
    phases: dict[str, float] = {}
    t0 = time.monotonic()

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - t0 - sum(phases.values()), 1)

    try:
        train_step(*new_step)
        gate = SourceGate(sources, tmp_path, round_index=1)
        running = pool.submit(coordinator.sync, "v2")
        gate.wait_parked(timeout_s=300, unless=running.done)  # round 0 sent, round 1 not begun
        phase("sync v2 to round 1")
        session = coordinator.session
        assert session is not None
        plan, participants = session.plan, session.participants
        victim = replica_rank(participants, 1)
        to_victim = bytes_per_round(plan, victim)
        # One message to replica 1 in round 0: its first progress report is that whole bucket landed
        messages = messages_to(plan, victim, 0)
        received = wait_received(coordinator, victim, to_victim[0], timeout_s=60)
        phase("round 0 landed")
        servers.kill_server(1)
        gate.open()
        report = running.result(timeout=300)
        phase("kill, sync v2 fails")
        after, after_label = generations(url0), HttpControl(url0).version()
        served = set(client.versions)
        retry = coordinator.sync("v2-retry")  # the dead server is still a replica of the spec
        phase("retry")
        # Replica 0 alone (the operator's way to drop a dead replica: the spec selects the rest)
        alone = [destination_ref("srv", NS, "sf-r0-", ParallelSpec.parse("tp=1"))]
        coordinator.update_spec(
            sync_spec(shared.setup.model, shared.namespace, shared.setup.src, alone, "v2")
        )
        without = coordinator.sync("v2-one-replica")
        synced, synced_label = generations(url0), HttpControl(url0).version()
        phase("sync replica 0 alone")
    finally:
        if gate is not None:
            gate.remove()
        pool.shutdown(wait=False, cancel_futures=True)
        coordinator.close()
        train_step(shared.setup, "v1")  # the shared sources back on v1
        client.stop.set()
        client.join(120)
    print("transfer kill phases (s):", phases)
    print(f"replica 1 (rank {victim}): bytes per round {to_victim}, reported received {received}")
    print("transfer kill report:", report.result, report.failure, [r.model_dump() for r in report.replicas])
    print("retry:", retry.failure)
    victim_name = participants[victim].name
    # During the transfer: replica 1 had landed all of round 0 and had bytes of two rounds to come
    assert to_victim[0] > 0 and to_victim[1] > 0 and to_victim[2] > 0, to_victim
    assert messages == 1 and received == to_victim[0]
    assert report.result is SyncResult.FAILED and report.failure is not None
    assert report.failure.step is SyncStep.TRANSFER, report.failure
    assert report.failure.reason == "ParticipantDied" and report.failure.rank == victim, report.failure
    assert victim_name in report.failure.message, (victim_name, report.failure.message)
    assert report.moved_bytes == 0 and report.stages.commit == 0.0  # no commit phase ran
    states = {r.replica: r for r in report.replicas}
    assert states[0].state is ReplicaState.SERVING and states[0].version == before_version
    assert states[1].state is ReplicaState.DEGRADED and states[1].version is None
    # Replica 0 did not commit: its previous version bit for bit, not the new weights' generation
    assert after == before
    assert after != new  # negative control: a commit of v2 would have shown here
    # Each settle of a sync (recovery, and after the abort) resumes replica 0 on the version its
    # rank holds; vLLM's label is unchanged, also when this module's proxy set the rank up afresh
    # after another proxy's commit (trial 2 alone: the rank's version is '', and the proxy keeps
    # the engine's label rather than label it '': engines/vllm_ranks.py)
    assert after_label == before_label
    assert "v2" not in served
    assert client.failed == 0, client.errors[:3]
    assert client.requests > 0
    # While the dead server is a replica of the spec, a sync fails at discovery naming it
    assert retry.result is SyncResult.FAILED and retry.failure is not None
    assert retry.failure.step is SyncStep.DISCOVER and victim_name.split("#")[0] in retry.failure.message
    # Replica 0 alone takes the new weights: their known generation (positive control)
    assert without.result is SyncResult.SUCCEEDED, without.failure
    assert synced == new and synced_label == "v2-one-replica"
