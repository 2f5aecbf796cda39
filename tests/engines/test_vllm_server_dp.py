"""A data-parallel `vllm serve` whose engines span two nodes (TP 1, dense Qwen3) as a destination.

The server is started as a multi-node DP deployment starts it, with vLLM's own `vllm serve`
(`sync_runtime/testing/vllm_cli.py`): a head (`--data-parallel-size 2 --data-parallel-size-local 1`,
DP rank 0, and vLLM's default of one API server per DP engine, so two API servers share its port)
and a headless node (`--headless --data-parallel-start-rank 1`, DP rank 1: an engine core and its
worker, no HTTP), each its own process group, both with `VLLM_SERVER_DEV_MODE=1`, the weightsync
backend from the installed package and dummy weights. On one machine the "nodes" are two process
trees meeting at the head's DP address 127.0.0.1. vLLM sends every weight-transfer route to all
its engines, the remote one included, so one proxy on the head's URL
(`VllmEngineRanks(HttpControl(url))`) holds both workers, each DP rank a replica of its own
(replicas 0 and 1 of the destination). The sources are the demo's Megatron-layout actors at TP 2.
Oracle: the reference cache's checkpoint-loaded TP 1 `VllmReplica` (the same entry as the other
server tests': a warm run starts no oracle engine).

Each DP rank's generation is asked for by vLLM's own `X-data-parallel-rank` header, and the
server's per-engine request counters (`/metrics`, label `engine`) prove where it ran. After the
sync both DP ranks generate as the oracle bit for bit; negative controls: the dummy weights
before the sync and a scrambled push differ on both, and a resync restores both. The commit
pauses the server once per sync and applies both replicas inside that one pause (runtime/commit
`engines_of`).
A declared DP other than the server's is named before any byte moves (the attacher's check, on
the real server's world sizes). The last test kills the headless node mid-transfer: the sync
fails in the transfer naming the dead worker, both replicas are reported out of serving (vLLM's
head waits on the dead engine for every DP rank's call, so neither rank answers), and the head's
engine, never paused, still serves v1 bit for bit with no failed request. One node with both DP
engines: the Kubernetes e2e's last test (tests/e2e/test_vllm_e2e.py); wide EP (the DP engines
one replica): test_vllm_server_wide_ep.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.kube.pods import world_size_problem
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.runtime.drive import STRAGGLER_GRACE_S
from sync_runtime.schema.report import NullReporter, ReplicaState, SyncReport, SyncResult, SyncStep
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.transfer_gate import SourceGate, bytes_per_round, replica_rank, wait_received
from sync_runtime.testing.vllm_models import PROMPTS
from sync_runtime.testing.vllm_server import Client, generate, per_dp_rank
from sync_runtime.testing.vllm_server_nodes import one_engine_per_node
from tests.support.vllm_deploy import deploy, destination_ref, rows_equal, sync_spec
from tests.support.vllm_server import attached

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-server-dp"
DP = 2
DST = ParallelSpec.parse(f"tp=1,replicas={DP}")
"""Each DP rank is a replica: the destination declares DP x (servers) replicas."""
TIMEOUT_S = 120
"""The killed-node trial's transferTimeoutSeconds (the sources wait at most this long parked): the
sync must fail well before it, once the ranks that can answer have (drive.STRAGGLER_GRACE_S)."""
RETRY_CONNECT_S = 15
"""Its retry's connectTimeoutSeconds, which also bounds discovery."""


def outputs_carry_versions() -> bool:
    """Whether this vLLM tags each output with the weight versions it was produced with
    (`weight_versions`: new in 0.32; `make test-vllm-compat` runs this module against 0.31)."""
    import vllm

    return not str(vllm.__version__).startswith("0.31.")


@pytest.fixture(scope="module")
def dp_server(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("dp-server")
    with deploy(
        "qwen3",
        directory / "v1",
        src="tp=2",
        dst=ParallelSpec.parse("tp=1"),
        namespace=NS,
        engines={},
        references={"ref": ("ref-server", {"tp": 1})},  # the other server tests' oracle entry
    ) as d:
        nodes = one_engine_per_node(d.setup.model.rsplit("/", 1)[0], directory, dp=DP)
        with nodes as (server, procs), attached(server, "dp-r0000", NS, ranks=DP) as (url, ranks):
            ray.get(ranks.ws_num_ranks.remote(), timeout=300)
            dst = [destination_ref("dp", NS, "dp-r", DST)]
            yield {
                "d": d,
                "url": url,
                "ranks": ranks,
                "dst": dst,
                "ref": d.reference_calls[0]["ref"],
                "nodes": [p.pid for p in procs],
            }


def test_each_dp_engine_is_a_replica_behind_one_proxy(dp_server: dict[str, Any]) -> None:
    control = HttpControl(dp_server["url"])
    assert (control.world_size(), control.data_parallel_size()) == (DP, DP)
    metas = ray.get(dp_server["ranks"].ws_meta.remote())
    assert [(m.coord.replica, m.coord.tp_rank, m.coord.pp_rank) for m in metas] == [(0, 0, 0), (1, 0, 0)]
    # one worker process per DP engine, each on its own "node": in that node's process group
    assert [os.getpgid(m.pid) for m in metas] == dp_server["nodes"]


def test_a_wrong_declared_dp_is_named_before_any_byte_moves(dp_server: dict[str, Any]) -> None:
    control = HttpControl(dp_server["url"])
    world, dp = control.world_size(), control.data_parallel_size()
    assert world_size_problem("dp", "pod-0", world, 1, 1, dp=DP, server_dp=dp) is None
    assert world_size_problem("dp", "pod-0", world, 1, 1, dp=1, server_dp=dp) == (
        "deployment 'dp': vLLM server pod pod-0 runs 2 data-parallel engine(s), "
        "the destination declares dataParallelSize=1"
    )


def _synced(coordinator: Coordinator, version: str) -> SyncReport:
    report = coordinator.sync(version)
    assert report.result is SyncResult.SUCCEEDED, report.failure
    assert [(r.replica, r.state, r.version) for r in report.replicas] == [
        (k, ReplicaState.SERVING, version) for k in range(DP)
    ]
    return report


def test_every_dp_rank_generates_as_the_checkpoint_after_the_sync(dp_server: dict[str, Any]) -> None:
    url, ref, d = dp_server["url"], dp_server["ref"], dp_server["d"]
    setup = d.setup
    before = per_dp_rank(url, DP)  # dummy weights
    coordinator = Coordinator(
        sync_spec(setup.model, NS, setup.src, dp_server["dst"], "v1"), NullReporter(), manifest=d.manifest
    )
    try:
        synced_report = _synced(coordinator, "v1")
        synced = per_dp_rank(url, DP)
        versions = [generate(url, PROMPTS[0], 300, dp_rank=k)[1] for k in range(DP)]
        train_step(dataclasses.replace(setup, seed=99), "scrambled")
        _synced(coordinator, "scrambled")
        scrambled = per_dp_rank(url, DP)
        train_step(setup, "v1")
        _synced(coordinator, "v1-again")
        again = per_dp_rank(url, DP)
    finally:
        coordinator.close()
        train_step(setup, "v1")
    pauses = ray.get(dp_server["ranks"].pause_seconds.remote())
    print(
        f"sync {synced_report.seconds:.2f} s (transfer {synced_report.stages.transfer:.2f} s), "
        f"pause_seconds={[round(p, 4) for p in pauses]}"
    )
    for k in range(DP):
        assert synced[k] == ref and again[k] == ref, k  # token ids and every logprob bit
        assert rows_equal(before[k], ref) == 0, k  # negative control: dummy weights
        assert rows_equal(scrambled[k], ref) == 0, k  # negative control: a scrambled push
    # both engines' outputs carry the sync's version: vLLM tags outputs with the weights' version
    # since 0.32; 0.31's answers carry none (there the server's own label, asserted next, is it)
    assert versions == ([["v1"]] if outputs_carry_versions() else [[]]) * DP, versions
    assert HttpControl(url).version() == "v1-again"
    assert len(pauses) == 3 and all(0 < p < 60 for p in pauses)  # one pause per sync, not per replica


def test_a_headless_node_killed_during_the_transfer_leaves_the_head_on_its_version(
    dp_server: dict[str, Any], tmp_path: Path
) -> None:
    """Last in the module: it ends the headless node (docs/vllm.md, "A node of such a server
    dies"). The sources are parked after round 0, and once DP rank 1's worker reported its round-0
    bytes its node's process group is SIGKILLed. vLLM's head does not notice a remote engine's
    death: its calls for every DP rank wait on the dead one, so the proxy's ranks stay in their
    transfer. Then a new sync (a fresh runtime) while the node is still dead: it fails at
    discovery within its connect timeout, naming the server's proxy, and applies nothing."""
    url, ref, d = dp_server["url"], dp_server["ref"], dp_server["d"]
    setup = d.setup
    # 1 MiB buckets, 2 MiB staging budget: three rounds, each with bytes for DP rank 1. The dead
    # rank behind the head never answers again: the sync ends STRAGGLER_GRACE_S after the first
    # failure (a source's broken send), not once the transfer timeout has passed
    small = {"bucket_mb": 1, "staging_budget_mb": 2, "delta": "off", "transfer_timeout_seconds": TIMEOUT_S}
    spec = sync_spec(setup.model, NS, setup.src, dp_server["dst"], "v1", **small)
    coordinator = Coordinator(spec, NullReporter(), manifest=d.manifest)
    sources = [h for _, h in find_actors(NS, setup.src_prefix)]
    # the head's own engine: its clients must see no error (a request every 0.5 s: the trial
    # waits out the straggler grace and the retry's connect timeout, and each generation costs
    # CPU the other lane needs)
    client = Client(url, 0.5, dp_rank=0)
    gate, pool = None, ThreadPoolExecutor(1)
    try:
        _synced(coordinator, "v1")
        client.start()
        train_step(dataclasses.replace(setup, seed=99), "scrambled")
        gate = SourceGate(sources, tmp_path, round_index=1)
        running = pool.submit(coordinator.sync, "v2")
        gate.wait_parked(timeout_s=300, unless=running.done)  # round 0 sent, round 1 not begun
        session = coordinator.session
        assert session is not None
        victim = replica_rank(session.participants, 1)
        to_victim = bytes_per_round(session.plan, victim)
        received = wait_received(coordinator, victim, to_victim[0], timeout_s=60)
        os.killpg(dp_server["nodes"][1], signal.SIGKILL)
        gate.open()
        started = time.monotonic()
        report = running.result(timeout=300)
        failed_in = time.monotonic() - started
        # A new sync while the node is still dead (a fresh runtime): the server's ranks cannot
        # answer discovery (vLLM sends the call to every DP engine), so it fails there, bounded
        # by the connect timeout, naming the server's proxy; nothing reaches any engine
        retry = {**small, "connect_timeout_seconds": RETRY_CONNECT_S}
        retry_spec = sync_spec(setup.model, NS, setup.src, dp_server["dst"], "v2", **retry)
        retrying = Coordinator(retry_spec, NullReporter(), manifest=d.manifest)
        started = time.monotonic()
        try:
            again_report = pool.submit(retrying.sync, "v2").result(timeout=600)
        finally:
            retrying.close()
        retry_in = time.monotonic() - started
        client.stop.set()
        client.join(120)
        head = per_dp_rank(url, 1)[0]  # DP rank 0 only: rank 1's engine is gone
    finally:
        if gate is not None:
            gate.remove()
        pool.shutdown(wait=False, cancel_futures=True)
        coordinator.close()
        client.stop.set()
        if client.ident is not None:  # started: a failure before it must not hide behind join()
            client.join(120)
        train_step(setup, "v1")
    print(f"headless node killed: failed in {failed_in:.1f} s: {report.failure}")
    print(f"DP rank 0's client: {client.requests} requests, {client.failed} failed")
    print(f"retry while the node is dead: failed in {retry_in:.1f} s: {again_report.failure}")
    print("retry replicas:", [(r.replica, r.state.value, r.rank_versions) for r in again_report.replicas])
    print("replicas:", [(r.replica, r.state.value, r.rank_versions) for r in report.replicas])
    assert to_victim[0] > 0 and to_victim[1] > 0 and received == to_victim[0], (to_victim, received)
    assert report.result is SyncResult.FAILED and report.failure is not None
    assert report.failure.step is SyncStep.TRANSFER, report.failure
    assert victim in (report.failure.rank, report.failure.peer), report.failure  # the dead worker
    assert session.participants[victim].name in report.failure.message, report.failure  # named too
    assert report.moved_bytes == 0 and report.stages.commit == 0.0  # no commit phase ran
    assert failed_in < STRAGGLER_GRACE_S + 20 < TIMEOUT_S  # not waiting out the transfer timeout
    proxy = session.participants[victim].name.partition("#")[0]
    refused = again_report.failure
    assert again_report.result is SyncResult.FAILED and refused is not None
    assert refused.step is SyncStep.DISCOVER and proxy in refused.message, refused
    assert retry_in < 3 * RETRY_CONNECT_S, retry_in
    # Every replica is named, out of serving, version unknown: their ranks never answered
    assert [(r.replica, r.state, r.version) for r in report.replicas] == [
        (k, ReplicaState.DEGRADED, None) for k in range(DP)
    ]
    # Nothing was applied: the head's engine, never paused, generates v1 bit for bit (a commit of
    # the scrambled weights would show: the scrambled push differs, see the test above)
    assert head == ref
    assert client.failed == 0 and client.requests > 0, client.errors[:3]
    assert "v2" not in client.versions
