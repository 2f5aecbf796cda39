"""Delta syncs into real vLLM destinations: dense Qwen3 (tied embeddings), TP 1, two replicas.

Sources: the demo's Megatron-layout actors (tp=2) taking sparse steps (sync_runtime/testing/
sparse_steps.py: ~3% of the elements move by one bf16 ulp, as an RL optimizer step does, and a
checkpoint of the same version is written from the canonical tensors). Destinations: two user's
engines through the weightsync plugin (`UserEngine` actors holding `vllm.LLM` with the weightsync
backend, attached with `ActorControl` as replicas 0 and 1), started with dummy weights, whose
ranks keep the bytes of their last commit as the base of the next delta (engines/vllm_delta.py):
the session's shared pair (tests/engines/conftest.py `qwen3_pair`, also synced by
test_vllm_dense, which runs after this module and kills one of them last); its workers carry this
module's base faults in a test worker extension (tests/support/vllm_delta_faults.py, called
through `collective_rpc`), which reach the weightsync backend's rank in each worker. Oracles:
vLLM loaded normally from the checkpoint of each version (through the reference cache).

Each sync is checked twice: the bytes every rank committed equal the version's shard, tensor by
tensor (checksums against the canonical weights sharded by the vllm layout), and the engines'
greedy generation is bit-identical to the checkpoint-loaded engine of that version. Trials in
order (each builds on the previous one's state): the first sync full, the second a delta; a
replica without its base (an engine restart) takes the next sync in full while the other takes
a delta (`mixed`); a replica whose kept base was altered fails the rebuilt region's checksum and
the sync is redone in full in the same run, then deltas resume.

The first tests need no engine: the staging's bookkeeping of its base.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.plan import Transfer
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.engines.vllm_apply import ApplyReport, EngineTensor
from sync_runtime.engines.vllm_worker import VllmStaging
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import find_actors
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.report import NullReporter, ReplicaState, SyncReport, SyncResult
from sync_runtime.testing.cluster import DemoSetup, create_participants, kill_participants
from sync_runtime.testing.sparse_steps import SteppedSource, stepped_weights, write_stepped_model
from sync_runtime.testing.weights import bits_to_torch
from sync_runtime.transfer.checksum import checksum_bytes, checksum_tensor, hex_digest, raw_bytes
from sync_runtime.transfer.delta_wire import DeltaIO, KeptBits, delta_io
from tests.support.vllm_deploy import (
    CONFIGS,
    PROMPTS,
    destination_ref,
    generations,
    rows_equal,
    stop_replicas,
    sync_spec,
)
from tests.support.vllm_oracle import finish_oracles, start_oracles
from tests.support.vllm_pair_faults import worker_call

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-delta"
SRC, DST = ParallelSpec.parse("tp=2"), ParallelSpec.parse("tp=1,replicas=2")
FRACTION = 0.03
ORACLES = {"v2": 1, "v3": 2, "v4": 3}
"""The versions checked against a checkpoint-loaded engine, and how many steps from v1 each is."""


# ---- the staging's base, without an engine -------------------------------------------------

EXPECTED = {
    "a.weight": EngineTensor("a.weight", (2, 3), "bfloat16", "bfloat16"),
    "b.weight": EngineTensor("b.weight", (4,), "bfloat16", "bfloat16"),
}


def _committed(s: VllmStaging, version: str, value: float) -> None:
    s.begin(version)
    for name in EXPECTED:
        s.staged(name, fully_written=True).fill_(value)
    s.commit(version)


def _staging(expected: dict[str, EngineTensor] = EXPECTED, fail: list[bool] | None = None) -> VllmStaging:
    def apply(staged: Any) -> ApplyReport:
        if fail and fail[0]:
            raise RuntimeError("vLLM post-processing failed")
        return ApplyReport(len(staged), len(staged), 0, ())

    return VllmStaging(expected, apply)


def test_a_commit_is_kept_as_the_base_of_its_version_only_while_deltas_may_come() -> None:
    s = _staging()
    _committed(s, "v1", 1.0)
    assert not s.holds_base and dict(s.delta_base) == {}  # keep_base off (delta off, NCCL): none kept
    s.keep_base = True
    _committed(s, "v2", 2.0)
    assert s.holds_base and set(s.delta_base) == set(EXPECTED)
    assert all(t.eq(2.0).all() for t in s.delta_base.values())  # the committed bytes, in wire shape
    assert {n: hex_digest(checksum_tensor(t)) for n, t in s.delta_base.items()} == s.checksums()
    s.begin("v3")
    s.staged("a.weight", fully_written=True).fill_(3.0)
    s.abort()  # an aborted sync leaves the base of the committed version
    assert s.holds_base and s.delta_base["a.weight"].eq(2.0).all()
    s.keep_base = False
    s.begin("v3")  # delta turned off: the copy is freed at the next sync's start
    assert not s.holds_base and dict(s.delta_base) == {}


def test_a_failed_apply_or_a_widened_tensor_holds_no_base() -> None:
    fail = [False]
    s = _staging(fail=fail)
    s.keep_base = True
    _committed(s, "v1", 1.0)
    assert s.holds_base
    fail[0] = True
    with pytest.raises(RuntimeError):
        _committed(s, "v2", 2.0)
    assert s.poisoned and not s.holds_base and dict(s.delta_base) == {}
    # staged in fp32 from a bf16 wire: a delta of wire bytes cannot rebuild widened staging
    widened = {
        **EXPECTED,
        "g.e_score_correction_bias": EngineTensor("g.e_score_correction_bias", (4,), "bfloat16", "float32"),
    }
    w = _staging(widened)
    w.keep_base = True
    w.begin("v1")
    for name in widened:
        w.staged(name, fully_written=True).fill_(1.0)
    w.commit("v1")
    assert set(w.delta_base) == set(widened) and not w.holds_base


def test_the_receiver_rebuilds_from_the_kept_base_and_a_wrong_base_fails_the_checksum() -> None:
    """Through the transfer's own DeltaIO (delta_io picks the staging's kept copy, not its meta
    tensors): the rebuilt staged region equals the new bytes, checksum and all; the same message
    over an altered base rebuilds other bytes, which the region's checksum catches."""
    old = torch.arange(0x3F00, 0x3F06, dtype=torch.int16).view(torch.bfloat16).reshape(2, 3)
    new = old.clone()
    new.view(torch.int16)[1, 2] ^= 1
    box = ((0, 2), (0, 3))
    t = Transfer(0, 1, "a", "a.weight", box, "a.weight", box, 12)
    kept = KeptBits()
    kept.record({"a.weight": old}, "v1")
    message = DeltaIO({1: "v1"}, kept).encode(t, 1, raw_bytes(new), new)
    want = checksum_bytes(raw_bytes(new))
    for alter, same in ((False, True), (True, False)):
        s = _staging()
        s.keep_base = True
        s.begin("v1")
        s.staged("a.weight", fully_written=True).copy_(old)
        s.staged("b.weight", fully_written=True).fill_(0)
        s.commit("v1")
        if alter:
            s.delta_base["a.weight"].view(torch.int16)[0, 0] ^= 1
        io = delta_io(((1, "v1"),), None, s)
        assert io is not None and io.live is not None and io.live["a.weight"].device.type == "cpu"
        s.begin("v2")
        region = s.staged("a.weight", fully_written=True)
        assert io.decode(t, message, region)
        assert (checksum_tensor(region) == want) is same
        assert torch.equal(region.view(torch.int16), new.view(torch.int16)) is same


# ---- real engines ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment(
    ray_address: str, qwen3_pair: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    config = CONFIGS["qwen3"]
    manifest = build_manifest(config)
    root = tmp_path_factory.mktemp("qwen3-delta")
    dirs = {
        v: write_stepped_model(root / v, config, stepped_weights(manifest, 0, "v1", steps, FRACTION))
        for v, steps in {"v1": 0, **ORACLES}.items()
    }
    setup = DemoSetup.create(f"{dirs['v1']}/config.json", SRC, DST, namespace=NS, seed=0)
    oracles = {v: start_oracles(dirs[v], NS, {"ref": (f"ref-{v}", {"tp": 1})}, 1) for v in ORACLES}
    try:
        create_participants(
            setup, src_version="v1", dst_version="-", source_class=lambda c: SteppedSource,
            skip=lambda c: c.role is Role.DESTINATION,
        )  # fmt: skip
        refs = {v: finish_oracles(o, timeout_s=800)["ref"]["calls"][0] for v, o in oracles.items()}
        dst = destination_ref("inference", qwen3_pair.namespace, qwen3_pair.prefix, DST)
        spec = sync_spec(setup.model, NS, SRC, [dst], "v1", bucket_mb=1, staging_budget_mb=2)
        engines = list(qwen3_pair.handles)  # the shared pair, at whatever version it was left
        proxies = list(qwen3_pair.proxies)  # their VllmEngineRanks (ws_meta, ws_rank_call)
        yield {
            "setup": setup,
            "manifest": manifest,
            "engines": engines,
            "proxies": proxies,
            "refs": refs,
            "spec": spec,
        }
    finally:
        stop_replicas([h for o in oracles.values() for h in o.started.values()])
        kill_participants(setup)


def _step(d: dict[str, Any], step: int, version: str) -> None:
    sources = [h for _, h in find_actors(NS, d["setup"].src_prefix)]
    assert sum(ray.get([h.ws_sparse_step.remote(step, FRACTION, version) for h in sources])) > 0


def _sync(d: dict[str, Any], version: str) -> SyncReport:
    coordinator = Coordinator(d["spec"], NullReporter(), manifest=d["manifest"])
    try:
        report = coordinator.sync(version)
    finally:
        coordinator.close()
    assert report.result is SyncResult.SUCCEEDED, report.failure
    assert {(r.version, r.state) for r in report.replicas} == {(version, ReplicaState.SERVING)}
    print(
        f"{version}: {report.encoding}, wire {report.wire_bytes} / full {report.full_bytes} bytes "
        f"({report.wire_bytes / report.full_bytes:.3f}), changed {report.changed_fraction}, "
        f"retried {report.delta_retried}, sync {report.seconds:.2f} s "
        f"(transfer {report.stages.transfer:.2f} s)"
    )
    return report


def _rank_call(proxy: Any, method: str) -> Any:
    """A rank protocol method of the replica's (one) rank, through its proxy."""
    return ray.get(proxy.ws_rank_call.remote(0, method, ()))


def _hook(engine: Any, method: str) -> Any:
    """A test hook of the replica's (one) worker: the pair's worker extension, by collective_rpc."""
    (answer,) = worker_call(engine, method)
    return answer


def _committed_as(d: dict[str, Any], steps: int) -> None:
    """Every rank committed exactly the version `steps` steps after v1, tensor by tensor, and kept
    those bytes as its base."""
    canon = stepped_weights(d["manifest"], 0, "v1", steps, FRACTION)
    layout = get_layout("vllm")
    for k, (engine, proxy) in enumerate(zip(d["engines"], d["proxies"], strict=True)):
        coord = RankCoord(role=Role.DESTINATION, replica=k)
        shard = materialize(layout.shard(d["manifest"], DST, coord), canon)
        want = {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in shard.items()}
        got = _rank_call(proxy, "ws_checksums")
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        assert not bad, f"replica {k}: {len(bad)} tensor(s) differ from the version's shard, e.g. {bad[0]}"
        assert _hook(engine, "wstest_base_checksums") == got  # the kept base: the committed bytes


def _generates_as(d: dict[str, Any], version: str) -> list:
    rows = generations(d["engines"])
    ref = d["refs"][version]
    assert rows[0] == ref and rows[1] == ref  # token ids and logprobs, bit for bit
    return rows


def test_the_second_sync_is_a_delta_and_generates_as_the_checkpoint(deployment: dict[str, Any]) -> None:
    d = deployment
    first = _sync(d, "v1")
    assert first.encoding == "full" and first.wire_bytes == first.full_bytes  # nothing to diff yet
    _committed_as(d, 0)
    v1_rows = generations(d["engines"])
    _step(d, 1, "v2")
    second = _sync(d, "v2")
    assert second.encoding == "delta" and not second.delta_retried
    assert second.full_bytes == first.full_bytes and second.wire_bytes < 0.25 * second.full_bytes
    assert second.changed_fraction is not None and 0.015 < second.changed_fraction < 0.06
    _committed_as(d, 1)
    _generates_as(d, "v2")
    # negative control: one ulp on ~3% of the weights is visible in the outputs
    assert rows_equal(v1_rows[0], d["refs"]["v2"]) < len(PROMPTS)


def test_a_replica_without_its_base_takes_the_sync_in_full_in_the_same_run(
    deployment: dict[str, Any],
) -> None:
    d = deployment
    _hook(d["engines"][1], "wstest_forget_base")  # as after an engine restart
    metas = [ray.get(p.ws_meta.remote())[0] for p in d["proxies"]]
    assert [m.live_base for m in metas] == [True, False]
    _step(d, 2, "v3")
    report = _sync(d, "v3")
    assert report.encoding == "mixed" and not report.delta_retried  # replica 0 delta, replica 1 full
    assert 0.45 * report.full_bytes < report.wire_bytes < 0.65 * report.full_bytes
    _committed_as(d, 2)
    _generates_as(d, "v3")


def test_an_altered_base_fails_the_checksum_and_is_repaired_in_full(deployment: dict[str, Any]) -> None:
    d = deployment
    altered = _hook(d["engines"][0], "wstest_alter_base")
    before = _rank_call(d["proxies"][0], "ws_checksums")
    assert _hook(d["engines"][0], "wstest_base_checksums")[altered] != before[altered]
    _step(d, 3, "v4")
    report = _sync(d, "v4")
    # the rebuilt region failed its checksum: nothing committed, the sync redone in full
    assert report.delta_retried and report.encoding == "full"
    _committed_as(d, 3)
    _generates_as(d, "v4")
    _step(d, 4, "v5")  # both hold their base again: deltas resume
    report = _sync(d, "v5")
    assert report.encoding == "delta" and not report.delta_retried
    _committed_as(d, 4)
