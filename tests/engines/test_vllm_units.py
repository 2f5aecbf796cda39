"""The vLLM integration's pieces without an engine: staging, rank handles, call batching.

Engine environment only (these modules may import vllm lazily); no engine starts, so this runs
in seconds.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest
import torch

from sync_runtime.engines.vllm_apply import ApplyReport, EngineTensor
from sync_runtime.engines.vllm_replica import VllmReplica
from sync_runtime.engines.vllm_worker import VllmStaging
from sync_runtime.errors import DestinationError, StagingError
from sync_runtime.runtime.discovery import RankHandle

pytestmark = [pytest.mark.engines, pytest.mark.vllm]
EXPECTED = {
    "a.weight": EngineTensor("a.weight", (2, 3), "bfloat16", "bfloat16"),
    "gate.e_score_correction_bias": EngineTensor("gate.e_score_correction_bias", (4,), "bfloat16", "float32"),
}


def _staging(fail: bool = False) -> tuple[VllmStaging, list[dict[str, torch.Tensor]]]:
    applied: list[dict[str, torch.Tensor]] = []

    def apply(staged: Any) -> ApplyReport:
        if fail:
            raise RuntimeError("vLLM post-processing failed")
        applied.append({n: t.clone() for n, t in staged.items()})
        return ApplyReport(len(staged), len(staged), 0, ())

    return VllmStaging(EXPECTED, apply), applied


def test_staging_is_host_buffers_and_commit_applies_all_at_once() -> None:
    s, applied = _staging()
    assert all(t.device.type == "meta" for t in s.tensors.values())  # no memory held for metadata
    s.begin("v1")
    s.staged("a.weight").fill_(1.5)
    s.staged("gate.e_score_correction_bias", fully_written=True).fill_(-2)
    assert s.staged("a.weight").device.type == "cpu"
    prepared = s.staged_checksum()
    assert s.commit("v1") == "v1" and s.version == "v1" and not s.staging_active
    assert applied[0]["a.weight"].eq(1.5).all() and prepared
    assert set(s.checksums()) == set(EXPECTED)


def test_a_partial_commit_is_refused_before_the_engine_is_touched() -> None:
    s, applied = _staging()
    s.begin("v1")
    s.staged("a.weight")
    with pytest.raises(DestinationError) as e:
        s.commit("v1")
    assert e.value.tensor == "gate.e_score_correction_bias" and applied == [] and s.version == ""
    s.abort()
    assert not s.staging_active and not s.poisoned


def test_unknown_tensor_and_wrong_version_are_staging_errors() -> None:
    s, _ = _staging()
    with pytest.raises(StagingError):
        s.staged("a.weight")  # before begin
    s.begin("v2")
    with pytest.raises(StagingError) as e:
        s.staged("lm_head.weight")
    assert e.value.tensor == "lm_head.weight"
    with pytest.raises(StagingError):
        s.commit("v3")


def test_a_failed_apply_poisons_the_rank() -> None:
    s, _ = _staging(fail=True)
    s.begin("v1")
    for name in EXPECTED:
        s.staged(name)
    with pytest.raises(RuntimeError):
        s.commit("v1")
    assert s.poisoned and s.version == ""


class _Actor:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.ws_rank_call = self

    def remote(self, *args: Any) -> str:
        self.calls.append(args)
        return "ref"


def test_rank_handle_forwards_calls_with_its_index() -> None:
    actor = _Actor()
    h = RankHandle(actor, 1)
    assert h.ws_run.remote("plan", "digest") == "ref"
    assert actor.calls == [(1, "ws_run", ("plan", "digest"))]
    with pytest.raises(AttributeError):
        _ = h._private


class _LLM:
    def __init__(self) -> None:
        self.rpcs: list[tuple[str, dict]] = []

    def collective_rpc(self, name: str, args: tuple) -> list[bytes]:
        method, payload = args
        per_rank = pickle.loads(payload)
        self.rpcs.append((method, per_rank))
        return [
            pickle.dumps(("ok", (method, per_rank[i])) if i in per_rank else ("skip", None)) for i in range(2)
        ]


def _replica() -> VllmReplica:
    r = object.__new__(VllmReplica)  # no engine: only the batching machinery
    r.llm = _LLM()  # type: ignore[assignment]
    r._engine = threading.Lock()
    r._init_batcher(2)
    return r


def test_calls_of_local_ranks_are_batched_into_one_collective_rpc() -> None:
    r = _replica()
    out: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, r.ws_rank_call(i, "ws_run", (f"plan{i}",))))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {0: ("ws_run", ("plan0",)), 1: ("ws_run", ("plan1",))}
    assert r.llm.rpcs == [("ws_run", {0: ("plan0",), 1: ("plan1",)})]  # type: ignore[attr-defined]


class _FailingLLM(_LLM):
    def collective_rpc(self, name: str, args: tuple) -> list[bytes]:
        super().collective_rpc(name, args)
        return [
            pickle.dumps(("error", DestinationError("apply failed", tensor="a.weight"))),
            pickle.dumps(("ok", 1)),
        ]


def test_a_rank_called_alone_still_runs_and_errors_stay_per_rank() -> None:
    r = _replica()
    assert r.ws_rank_call(1, "ws_version", ()) == ("ws_version", ())  # after the gather window
    r.llm = _FailingLLM()  # type: ignore[assignment]
    with pytest.raises(DestinationError) as e:
        r.ws_rank_call(0, "ws_commit", ("v1",))
    assert e.value.tensor == "a.weight"
    assert r.ws_rank_call(1, "ws_commit", ("v1",)) == 1
    with pytest.raises(DestinationError):
        r.ws_rank_call(5, "ws_commit", ("v1",))  # no such local rank


def test_staging_buffers_have_the_live_dtype_not_the_reported_one() -> None:
    # The fp32 router bias is reported in the checkpoint dtype (bf16) but staged in fp32: an fp32
    # wire (Megatron's expert_bias) lands without loss, a bf16 one is widened once on receipt.
    s, _ = _staging()
    assert s.tensors["gate.e_score_correction_bias"].dtype == torch.bfloat16
    s.begin("v1")
    assert s.staged("gate.e_score_correction_bias").dtype == torch.float32
    assert s.staged("a.weight").dtype == torch.bfloat16
