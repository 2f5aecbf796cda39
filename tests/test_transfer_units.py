"""In-process tests of the transfer engine's pure parts: checksum, message packing, staging, plan checks."""

from __future__ import annotations

import pytest
import torch

from sync_runtime.plan import Bucket, RankPlan, Transfer
from sync_runtime.transfer import (
    DestinationWeights,
    PlanMismatchError,
    StagingError,
    verify_plan_against_tensors,
)
from sync_runtime.transfer.buffers import message_layout, pack_bucket, unpack_bucket
from sync_runtime.transfer.checksum import CHUNK_WORDS, checksum_bytes, checksum_tensor


def _rand_bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("numel", [1, 3, 1000, 2 * CHUNK_WORDS + 7])
def test_checksum_detects_flipped_byte_anywhere(numel: int) -> None:
    t = _rand_bf16(numel)
    base = checksum_tensor(t)
    raw = t.view(torch.uint8)
    for pos in {0, raw.numel() // 2, raw.numel() - 1}:
        bad = raw.clone()
        bad[pos] ^= 0x10
        assert checksum_bytes(bad) != base, pos


def test_checksum_detects_swapped_elements() -> None:
    t = _rand_bf16(5 * CHUNK_WORDS)  # bf16: swaps inside one word, across words and across chunks
    base = checksum_tensor(t)
    for i, j in [(0, 1), (0, 2), (10, 4000), (5, 3 * CHUNK_WORDS + 5), (7, 2 * CHUNK_WORDS + 8)]:
        bad = t.clone()
        bad[i], bad[j] = t[j], t[i]
        assert not torch.equal(bad.view(torch.int16), t.view(torch.int16))
        assert checksum_tensor(bad) != base, (i, j)


def test_checksum_of_view_equals_checksum_of_copy_and_is_stable() -> None:
    t = _rand_bf16(16, 10)
    view = t[3:9, 2:7]
    assert checksum_tensor(view) == checksum_tensor(view.contiguous())
    assert checksum_tensor(t[1:]) == checksum_tensor(t[1:].clone())  # unaligned start
    assert checksum_tensor(t) == checksum_tensor(t.clone())


def _transfer(src_name: str, src_box, dst_name: str, dst_box, elem: int = 2) -> Transfer:
    n = 1
    for a, b in src_box:
        n *= b - a
    return Transfer(0, 1, src_name, src_name, tuple(src_box), dst_name, tuple(dst_box), n * elem)


def test_pack_unpack_roundtrip_mixed_dtypes_and_leading_dims() -> None:
    a = _rand_bf16(8, 6)
    b = torch.arange(5, dtype=torch.float32)
    bucket = Bucket(0, 1, (
        _transfer("a", [(1, 4), (0, 3)], "x", [(0, 3), (3, 6)]),
        _transfer("b", [(0, 5)], "y", [(1, 2), (0, 5)], elem=4),
        _transfer("a", [(7, 8), (5, 6)], "x", [(4, 5), (0, 1)]),
    ), 0)  # fmt: skip
    msg = pack_bucket(bucket, {"a": a, "b": b}.__getitem__, torch.device("cpu"))
    assert msg.numel() == message_layout(bucket).nbytes
    dw = DestinationWeights({"x": torch.ones(5, 6, dtype=torch.bfloat16), "y": torch.ones(2, 5)})
    dw.begin("v1")
    assert unpack_bucket(bucket, msg, dw.staged) == []
    x, y = dw.staged("x"), dw.staged("y")
    assert torch.equal(x[0:3, 3:6].view(torch.int16), a[1:4, 0:3].view(torch.int16))
    assert torch.equal(y[1], b) and torch.equal(y[0], torch.zeros(5))  # unwritten regions are zero
    msg[3] ^= 1  # inside the first transfer's bytes
    dw.begin("v1")
    assert unpack_bucket(bucket, msg, dw.staged) == [bucket.transfers[0]]


def test_destination_weights_commit_in_place_and_abort_keeps_live() -> None:
    live = torch.zeros(4, dtype=torch.float32)
    dw = DestinationWeights({"w": live}, version="v0")
    before = dw.checksums()
    dw.begin("v1")
    dw.staged("w").fill_(3.0)
    dw.abort()
    assert dw.checksums() == before and dw.version == "v0"
    with pytest.raises(StagingError):
        dw.commit()
    dw.begin("v2")
    dw.staged("w").fill_(2.0)
    assert dw.commit() == "v2"
    assert dw.tensors["w"] is live and torch.equal(live, torch.full((4,), 2.0))
    assert dw.checksums() != before and not dw.staging_active


def test_verify_plan_names_rank_tensor_box_and_shape() -> None:
    t = Transfer(0, 1, "w", "w_src", ((0, 2), (0, 8)), "w_dst", ((0, 2), (0, 8)), 32)
    plan_src = RankPlan(0, "d", ((Bucket(0, 1, (t,), 32),),), ((),))
    plan_dst = RankPlan(1, "d", ((),), ((Bucket(0, 1, (t,), 32),),))
    verify_plan_against_tensors(plan_src, {"w_src": torch.zeros(2, 8, dtype=torch.bfloat16)}, None)
    with pytest.raises(
        PlanMismatchError, match=r"rank 0: source tensor 'w_src'.*outside local shape \(2, 4\)"
    ):
        verify_plan_against_tensors(plan_src, {"w_src": torch.zeros(2, 4, dtype=torch.bfloat16)}, None)
    with pytest.raises(
        PlanMismatchError, match=r"rank 1: destination tensor 'w_dst'.*torch.float32.*moves 32"
    ):
        verify_plan_against_tensors(plan_dst, None, DestinationWeights({"w_dst": torch.zeros(2, 8)}))
    with pytest.raises(PlanMismatchError, match="holds no tensor"):
        verify_plan_against_tensors(plan_dst, None, DestinationWeights({}))
