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

Delta syncs into the server (the last test): a delta-off sync drops both sides' kept copies
whatever the server held, then v1 goes in full with `delta: auto` (the server keeps its base),
the sources take a sparse step (sync_runtime/testing/sparse_steps.py: ~3% of the elements move
by one bf16 ulp) and that version goes as a delta. The server then holds exactly its shard
(committed checksums), its kernels read what a checkpoint-loaded engine of it reads (kernel
checksums), and generates as that engine bit for bit; v1's oracle disagrees. The sources are
left on v1 and the server on the stepped weights (each test syncs what it needs first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.schema.report import NullReporter, SyncReport, SyncResult
from sync_runtime.testing.cluster import DemoSetup, train_step
from sync_runtime.testing.sparse_steps import SteppedSource, stepped_weights, write_stepped_model
from sync_runtime.testing.vllm_models import PROMPTS
from sync_runtime.testing.weights import bits_to_torch
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from tests.support.vllm_deploy import CONFIGS, destination_ref, rows_equal, sync_spec
from tests.support.vllm_oracle import finish_oracles, start_oracles
from tests.support.vllm_server import Client, generate, generations

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
DST = ParallelSpec.parse("tp=1")
FRACTION = 0.03
"""The sparse step's share of elements moved by one ulp (as in tests/engines/test_vllm_delta.py,
whose oracle of the same stepped checkpoint is the same reference-cache entry)."""


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
            "dst": dst,
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


# ---- delta syncs into the server ------------------------------------------------------------


def _sparse_step(setup: DemoSetup, step: int, version: str) -> None:
    """A sparse step in place on every shared source. They are the demo's `DemoSource` actors
    (tests/support/shared_server.py), so SteppedSource's step runs inside them via `__ray_call__`
    (it only reads the state every DemoSource holds)."""
    sources = [h for _, h in find_actors(setup.namespace, setup.src_prefix)]
    step_fn = SteppedSource.ws_sparse_step
    assert sum(ray.get([h.__ray_call__.remote(step_fn, step, FRACTION, version) for h in sources])) > 0


def _shard_checksums(manifest: Manifest, seed: int, steps: int) -> dict[str, str]:
    """Per tensor, the checksum of the server rank's shard of v1 after `steps` sparse steps."""
    canon = stepped_weights(manifest, seed, "v1", steps, FRACTION)
    shard = materialize(get_layout("vllm").shard(manifest, DST, RankCoord(role=Role.DESTINATION)), canon)
    return {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in shard.items()}


def _synced(coordinator: Coordinator, version: str) -> SyncReport:
    report = coordinator.sync(version)
    assert report.result is SyncResult.SUCCEEDED, report.failure
    print(
        f"{version}: {report.encoding}, wire {report.wire_bytes} / full {report.full_bytes} bytes "
        f"({report.wire_bytes / max(report.full_bytes, 1):.3f}), changed {report.changed_fraction}, "
        f"retried {report.delta_retried}, sync {report.seconds:.2f} s "
        f"(transfer {report.stages.transfer:.2f} s)"
    )
    return report


def _full_sync_with_delta_off(server: dict[str, Any], version: str) -> SyncReport:
    setup = server["setup"]
    spec = sync_spec(setup.model, setup.namespace, setup.src, server["dst"], version, delta="off")
    coordinator = Coordinator(spec, NullReporter(), manifest=server["manifest"])
    try:
        return _synced(coordinator, version)
    finally:
        coordinator.close()


def test_a_sparse_step_goes_as_a_delta_and_generates_as_its_checkpoint(
    server: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    setup, manifest, url, ranks = server["setup"], server["manifest"], server["url"], server["ranks"]

    def rank_call(method: str) -> Any:
        return ray.get(ranks.ws_rank_call.remote(0, method, ()))

    def holds_base() -> bool:
        return bool(ray.get(ranks.ws_meta.remote())[0].live_base)

    # The stepped version's oracle: on a reference-cache miss its engine starts while the syncs run.
    stepped = stepped_weights(manifest, setup.seed, "v1", 1, FRACTION)
    b_dir = write_stepped_model(tmp_path_factory.mktemp("server-delta-b"), CONFIGS["qwen3"], stepped)
    oracles = start_oracles(b_dir, setup.namespace, {"ref": ("ref-server-b", {"tp": 1})}, 1)
    coordinator = Coordinator(server["spec"], NullReporter(), manifest=manifest)
    try:
        # Whatever the shared server held: delta off drops the kept copies on both sides ...
        assert _full_sync_with_delta_off(server, "delta-a0").encoding == "full" and not holds_base()
        # ... so v1 goes in full with delta auto (no source copy to diff against), and is kept.
        a = _synced(coordinator, "delta-a")
        assert a.encoding == "full" and a.wire_bytes == a.full_bytes and holds_base()
        a_rows, a_kernels = generations(url), rank_call("ws_kernel_checksums")
        assert a_rows == server["ref"]  # v1's checkpoint-loaded engine, bit for bit
        assert rank_call("ws_checksums") == _shard_checksums(manifest, setup.seed, 0)
        _sparse_step(setup, 1, "delta-b")
        b = _synced(coordinator, "delta-b")
        b_rows, b_kernels = generations(url), rank_call("ws_kernel_checksums")
        b_committed = rank_call("ws_checksums")
        _, versions = generate(url, PROMPTS[0])
    finally:
        coordinator.close()
        train_step(setup, "v1")  # the shared sources' contract: v1 between tests
        oracle = finish_oracles(oracles, timeout_s=800)["ref"]  # stops the engine it started
    assert b.encoding == "delta" and not b.delta_retried and holds_base()
    assert b.full_bytes == a.full_bytes and b.wire_bytes < 0.25 * b.full_bytes
    assert b.changed_fraction is not None and 0.015 < b.changed_fraction < 0.06
    assert b_committed == _shard_checksums(manifest, setup.seed, 1)  # exactly the stepped shard
    assert b_kernels == oracle["kernels"][0]  # what the kernels read, derived tensors too
    assert b_rows == oracle["calls"][0]  # token ids and every logprob bit
    assert versions == ["delta-b"] and HttpControl(url).version() == "delta-b"
    # negative controls: one ulp on ~3% of the weights shows in the outputs and the kernels
    assert rows_equal(b_rows, server["ref"]) < len(PROMPTS)
    assert rows_equal(a_rows, oracle["calls"][0]) < len(PROMPTS)
    assert a_kernels != oracle["kernels"][0]
