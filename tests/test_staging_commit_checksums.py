"""A vLLM rank's commit takes its committed checksums from the two-phase commit's re-check.

The commit re-reads every staged byte (refusing bytes that changed after the decision); the
per-tensor checksums the rank then reports as committed are those of that same read, so the
pause holds one pass over the staging, not two. Any buffer handed out after the re-check (its
holder may write) makes the commit read the bytes again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sync_runtime.engines.vllm_worker as vllm_worker
from sync_runtime.engines.vllm_apply import ApplyReport, EngineTensor
from sync_runtime.engines.vllm_worker import VllmStaging
from sync_runtime.errors import ChecksumMismatch
from sync_runtime.runtime import participant_txn
from sync_runtime.transfer import LocalTxn
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from sync_runtime.transfer.staging import combine_checksums

pytestmark = pytest.mark.unit

EXPECTED = {
    "a.weight": EngineTensor("a.weight", (64, 32), "bfloat16", "bfloat16"),
    "b.bias": EngineTensor("b.bias", (7,), "bfloat16", "float32"),
}


class Counting:
    """checksum_tensor as the worker module calls it, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t: torch.Tensor) -> int:
        self.calls += 1
        return checksum_tensor(t)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counting:
    c = Counting()
    monkeypatch.setattr(vllm_worker, "checksum_tensor", c)
    return c


def _staged(version: str = "v1") -> tuple[VllmStaging, list[dict[str, torch.Tensor]]]:
    applied: list[dict[str, torch.Tensor]] = []

    def apply(staged: Any) -> ApplyReport:
        applied.append({n: t.clone() for n, t in staged.items()})
        return ApplyReport(len(staged), len(staged), 0, ())

    s = VllmStaging(EXPECTED, apply)
    s.begin(version)
    torch.manual_seed(0)
    for name in EXPECTED:
        buf = s.staged(name, fully_written=True)
        buf.copy_(torch.randn(buf.shape))
    return s, applied


def _direct(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hex_digest(checksum_tensor(t)) for n, t in tensors.items()}


def _prepared(s: VllmStaging) -> LocalTxn:
    local = LocalTxn("txn-1", "v1")
    local.checksum, local.phase = s.staged_checksum(), "prepared"
    return local


def test_commit_reuses_the_recheck_and_reports_the_applied_bytes(counted: Counting) -> None:
    s, applied = _staged()
    local = _prepared(s)
    assert counted.calls == len(EXPECTED)
    counted.calls = 0
    assert participant_txn.commit(s, None, local, 0, "v1") == "v1"
    assert counted.calls == len(EXPECTED)  # the re-check only: before this change, twice as many
    assert s.checksums() == _direct(applied[0])
    assert local.checksum == combine_checksums(applied[0])  # the digest format is unchanged


def test_a_buffer_handed_out_after_the_recheck_is_read_again(counted: Counting) -> None:
    s, applied = _staged()
    s.staged_checksum()
    s.staged("a.weight").add_(1.0)  # written after the last read: the cached sums are stale
    counted.calls = 0
    s.commit("v1")
    assert counted.calls == len(EXPECTED)
    assert s.checksums() == _direct(applied[0])  # of the bytes applied, the write included


def test_commit_without_a_recheck_checksums_itself(counted: Counting) -> None:
    s, applied = _staged()
    s.commit("v1")
    assert counted.calls == len(EXPECTED)
    assert s.checksums() == _direct(applied[0])


def test_bytes_changed_after_prepare_are_never_applied() -> None:
    s, applied = _staged()
    local = _prepared(s)
    # a write that bypasses staged() (a stray writer holding the buffer): the re-check reads it
    s._staged["b.bias"][0] += 1.0  # type: ignore[index]
    with pytest.raises(ChecksumMismatch, match="changed after the decision"):
        participant_txn.commit(s, None, local, 0, "v1")
    assert applied == [] and s.version == ""


def test_a_new_sync_starts_without_the_previous_sums(counted: Counting) -> None:
    s, _ = _staged()
    s.staged_checksum()
    s.abort()
    s.begin("v2")
    for name in EXPECTED:
        s.staged(name, fully_written=True).fill_(3.0)
    counted.calls = 0
    s.commit("v2")
    assert counted.calls == len(EXPECTED)
    assert s.checksums()["a.weight"] == hex_digest(
        checksum_tensor(torch.full((64, 32), 3.0, dtype=torch.bfloat16))
    )
