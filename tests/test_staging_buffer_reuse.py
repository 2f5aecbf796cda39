"""A vLLM rank's full syncs stage into the buffers of its previous commit (no page faults).

Reused only after a commit (every receive into them completed), never those an aborted sync
handed out (a failed transfer may still write them), and never the buffers kept as the delta
base (a delta is rebuilt from the base into staging: they must not alias).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sync_runtime.engines.vllm_apply import ApplyReport, EngineTensor
from sync_runtime.engines.vllm_worker import VllmStaging

pytestmark = pytest.mark.unit

EXPECTED = {
    "embed.weight": EngineTensor("embed.weight", (10, 4), "bfloat16", "bfloat16"),
    "b.bias": EngineTensor("b.bias", (7,), "bfloat16", "float32"),
}


def _staging(*, pinned: bool = False) -> tuple[VllmStaging, list[dict[str, torch.Tensor]]]:
    applied: list[dict[str, torch.Tensor]] = []

    def apply(staged: Any) -> ApplyReport:
        applied.append({n: t.clone() for n, t in staged.items()})
        return ApplyReport(len(staged), len(staged), 0, ())

    return VllmStaging(EXPECTED, apply, pinned=pinned), applied


def _fill(s: VllmStaging, version: str, value: float, *, padded: bool = False) -> dict[str, int]:
    """Stage `version` (every element `value`; with `padded`, the embedding's last 2 rows are
    never written, as vocab padding); the data pointers of its buffers."""
    s.begin(version)
    emb = s.staged("embed.weight", fully_written=not padded)
    (emb[:8] if padded else emb).fill_(value)
    s.staged("b.bias", fully_written=True).fill_(value)
    return {n: s.staged(n).data_ptr() for n in EXPECTED}


def test_a_full_sync_stages_into_the_last_commits_buffers() -> None:
    s, applied = _staging()
    first = _fill(s, "v1", 1.0)
    s.commit("v1")
    second = _fill(s, "v2", 2.0)
    assert second == first
    s.commit("v2")
    assert applied[1]["embed.weight"].eq(2.0).all() and applied[0]["embed.weight"].eq(1.0).all()


def test_a_reused_buffer_not_fully_written_is_zeroed_first() -> None:
    s, applied = _staging()
    _fill(s, "v1", 1.0)
    s.commit("v1")
    _fill(s, "v2", 2.0, padded=True)
    s.commit("v2")
    assert applied[1]["embed.weight"][8:].eq(0).all()  # not v1's bytes where nothing landed
    assert applied[1]["embed.weight"][:8].eq(2.0).all()


def test_buffers_of_an_aborted_sync_are_never_reused() -> None:
    s, _ = _staging()
    _fill(s, "v1", 1.0)
    s.commit("v1")
    aborted = _fill(s, "v2", 2.0)
    s.abort()
    third = _fill(s, "v3", 3.0)
    assert all(third[n] != aborted[n] for n in EXPECTED)


def test_the_delta_base_is_never_staged_into() -> None:
    s, _ = _staging()
    s.keep_base = True
    first = _fill(s, "v1", 1.0)
    s.commit("v1")
    assert {n: t.data_ptr() for n, t in s.delta_base.items()} == first
    second = _fill(s, "v2", 2.0)
    assert all(second[n] != first[n] for n in EXPECTED)
    assert s.delta_base["embed.weight"].eq(1.0).all()  # the base still holds v1


def test_no_spare_is_held_while_the_base_is_kept() -> None:
    s, _ = _staging()
    full = _fill(s, "v1", 1.0)
    s.commit("v1")  # delta off: its buffers are the spare
    s.keep_base = True
    second = _fill(s, "v2", 2.0)  # staged into the spare, which then becomes the base
    assert second == full
    s.commit("v2")
    third = _fill(s, "v3", 3.0)
    assert all(third[n] != second[n] for n in EXPECTED)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_cuda_workers_staging_is_page_locked(pinned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer a rank allocates asks for page-locked memory exactly when the rank is pinned
    (a CUDA worker: vllm_worker._ws_setup). No CUDA here: the allocation itself runs unpinned."""
    asked: list[bool] = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def alloc(*args: Any, _real: Any = real, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("device") == "cpu":  # a staging buffer (the tensors' meta ones are not)
                asked.append(pin_memory)
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, alloc)
    s, _ = _staging(pinned=pinned)
    _fill(s, "v1", 1.0, padded=True)  # one zeroed (padded) buffer, one uninitialised
    assert asked == [pinned, pinned]
