"""In-process tests of the transfer engine's pure parts: checksum, message packing, staging, plan checks."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from sync_runtime.core.plan import Bucket, RankPlan, Transfer
from sync_runtime.errors import (
    ConnectError,
    ParticipantDied,
    PeerFailed,
    PlanMismatchError,
    Reason,
    StagingError,
    SyncStep,
)
from sync_runtime.transfer import (
    DestinationWeights,
    SyncGroup,
    publish_failure,
    verify_plan_against_tensors,
)
from sync_runtime.transfer.buffers import (
    BufferPool,
    Outgoing,
    message_layout,
    pack_bucket,
    receive_bucket,
    unpack_bucket,
)
from sync_runtime.transfer.checksum import BLOCK_WORDS, COLS, RAW_MAX_BYTES, checksum_bytes, checksum_tensor
from sync_runtime.transfer.staging import tiles_exactly

pytestmark = pytest.mark.unit


def _rand_bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


# bf16 elements: hashed raw (three sizes), whole rows and 2 loose bytes just above RAW_MAX_BYTES,
# whole blocks, whole rows after them, then loose bytes.
@pytest.mark.parametrize("numel", [1, 3, 1000, RAW_MAX_BYTES // 2 + 1, 8 * BLOCK_WORDS + 12 * COLS + 7])
def test_checksum_detects_flipped_byte_anywhere(numel: int) -> None:
    t = _rand_bf16(numel)
    base = checksum_tensor(t)
    raw = t.view(torch.uint8)
    for pos in {0, raw.numel() // 2, raw.numel() - 1}:
        bad = raw.clone()
        bad[pos] ^= 0x10
        assert checksum_bytes(bad) != base, pos


def test_checksum_detects_swapped_elements() -> None:
    # bf16, 4 per word: inside one word, along a row, down a column, across blocks, into the rows
    # after the last whole block and into the bytes no row covers.
    words = 2 * BLOCK_WORDS + 3 * COLS + 5
    t = _rand_bf16(4 * words)
    base = checksum_tensor(t)
    col = 4 * COLS  # the element one row below
    last = 4 * 2 * BLOCK_WORDS
    pairs = [(0, 1), (0, 2), (3, 4), (10, 4000), (5, 5 + col), (7, 7 + 9 * col), (6, 4 * BLOCK_WORDS + 6)]
    pairs += [(11, last + 11), (last + 1, last + 1 + col)]
    pairs += [(12, 4 * words - 2), (4 * words - 1, 4 * words - 5)]
    for i, j in pairs:
        bad = t.clone()
        bad[i], bad[j] = t[j], t[i]
        assert not torch.equal(bad.view(torch.int16), t.view(torch.int16))
        assert checksum_tensor(bad) != base, (i, j)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checksum_detects_sign_swap_in_every_lane(dtype: torch.dtype) -> None:
    # x <-> -x differs only in the top bit: the case a weighted sum of 64-bit words misses.
    t = _rand_bf16(BLOCK_WORDS + 2 * COLS).to(dtype)
    lanes = 8 // t.element_size()
    for lane in range(lanes):
        for w1, w2 in [(3, 11), (3, 3 + 2 * COLS)]:  # words in one row, in one column
            i, j = lanes * w1 + lane, lanes * w2 + lane
            t[i], t[j] = 1.5, -1.5
            bad = t.clone()
            bad[i], bad[j] = t[j], t[i]
            assert checksum_tensor(bad) != checksum_tensor(t), (lane, w1, w2)


def test_checksum_detects_a_piece_landed_one_word_off() -> None:
    t = _rand_bf16(4 * (BLOCK_WORDS + 100))
    bad = t.clone()
    bad[4004:8004] = t[4000:8000]  # a region written one word too far
    assert checksum_tensor(bad) != checksum_tensor(t)
    assert checksum_tensor(t[:-4]) != checksum_tensor(t)  # one word shorter


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


@pytest.mark.parametrize("direct_min_bytes", [0, 16, 1 << 20])
def test_pack_unpack_roundtrip_mixed_dtypes_and_leading_dims(direct_min_bytes: int) -> None:
    # 0: every transfer its own message; 16: all but the 2-byte one; 1 MiB: all packed in the tail.
    a = _rand_bf16(8, 6)
    b = torch.arange(5, dtype=torch.float32)
    bucket = Bucket(0, 1, (
        _transfer("a", [(1, 4), (0, 3)], "x", [(0, 3), (3, 6)]),  # strided on both ends: bounced
        _transfer("b", [(0, 5)], "y", [(1, 2), (0, 5)], elem=4),  # contiguous on both ends: in place
        _transfer("a", [(7, 8), (5, 6)], "x", [(4, 5), (0, 1)]),
    ), 0)  # fmt: skip
    cpu = torch.device("cpu")
    out = pack_bucket(bucket, {"a": a, "b": b}.__getitem__, cpu, direct_min_bytes=direct_min_bytes)
    layout = message_layout(bucket, direct_min_bytes)
    assert len(out.messages) == layout.count and out.tail.numel() == layout.tail_nbytes
    if direct_min_bytes == 0:
        assert out.messages[1].data_ptr() == b.data_ptr() and not out.pooled[1]  # sent from the source
    dw = DestinationWeights({"x": torch.ones(5, 6, dtype=torch.bfloat16), "y": torch.ones(2, 5)})
    dw.begin("v1")
    assert unpack_bucket(bucket, out, dw.staged, cpu, direct_min_bytes) == []
    x, y = dw.staged("x"), dw.staged("y")
    assert torch.equal(x[0:3, 3:6].view(torch.int16), a[1:4, 0:3].view(torch.int16))
    assert torch.equal(y[1], b) and torch.equal(y[0], torch.zeros(5))  # unwritten regions are zero
    for m in range(len(out.messages)):  # a flipped byte in any message is caught
        bad = [t.clone() for t in out.messages]
        bad[m][1] ^= 1  # a data byte of the message's first transfer (or the header's first sum)
        dw.begin("v1")
        got = unpack_bucket(bucket, Outgoing(bad, out.pooled), dw.staged, cpu, direct_min_bytes)
        want_index = layout.direct[m] if m < len(layout.direct) else layout.packed[0] if layout.packed else 0
        assert got == [bucket.transfers[want_index]], (m, got)


def test_pack_emits_each_direct_message_before_reading_the_next_transfer() -> None:
    # The engine posts what `emit` gets at once: a direct message must be handed over before
    # the next transfer's source is read, complete, and never the tail (it carries the checksums).
    a, b = _rand_bf16(8, 6), torch.arange(5, dtype=torch.float32)
    bucket = Bucket(0, 1, (
        _transfer("a", [(0, 8), (0, 6)], "x", [(0, 8), (0, 6)]),
        _transfer("b", [(0, 5)], "y", [(0, 5)], elem=4),
        _transfer("a", [(7, 8), (5, 6)], "z", [(0, 1), (0, 1)]),  # 2 bytes: packed in the tail
    ), 0)  # fmt: skip
    events: list[str] = []

    def source(name: str) -> torch.Tensor:
        events.append(f"read {name}")
        return {"a": a, "b": b}[name]

    def emit(msg: torch.Tensor) -> None:
        events.append(f"emit {msg.numel()}")

    out = pack_bucket(bucket, source, torch.device("cpu"), direct_min_bytes=16, emit=emit)
    assert events[:4] == ["read a", "emit 96", "read b", "emit 20"], events
    assert "emit" not in " ".join(events[4:])  # the packed transfer's read, no tail emitted
    assert len(out.messages) == 3 and out.tail.numel() == message_layout(bucket, 16).tail_nbytes


def test_receive_in_place_into_staging() -> None:
    bucket = Bucket(0, 1, (_transfer("a", [(2, 6), (0, 4)], "x", [(0, 1), (1, 5), (0, 4)]),), 32)
    dw = DestinationWeights({"x": torch.zeros(2, 6, 4, dtype=torch.bfloat16)})
    dw.begin("v1")
    inc = receive_bucket(bucket, dw.staged, torch.device("cpu"), BufferPool(), 0)
    assert inc.messages[0].data_ptr() == dw.staged("x")[0, 1].data_ptr() and not inc.pooled[0]


def test_tiles_exactly() -> None:
    assert tiles_exactly([((0, 2), (0, 4)), ((2, 5), (0, 4))], (5, 4))
    assert tiles_exactly([((0, 5), (0, 1)), ((0, 5), (1, 4))], (5, 4))
    assert not tiles_exactly([((0, 2), (0, 4)), ((2, 4), (0, 4))], (5, 4))  # padding rows left
    assert not tiles_exactly([((0, 3), (0, 4)), ((2, 4), (0, 4))], (4, 5))  # sizes add up, boxes overlap
    assert tiles_exactly([()], ())


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
    ) as e:
        verify_plan_against_tensors(plan_src, {"w_src": torch.zeros(2, 4, dtype=torch.bfloat16)}, None)
    assert (e.value.rank, e.value.tensor, e.value.step) == (0, "w", SyncStep.PLAN)
    with pytest.raises(
        PlanMismatchError, match=r"rank 1: destination tensor 'w_dst'.*torch.float32.*moves 32"
    ) as e:
        verify_plan_against_tensors(plan_dst, None, DestinationWeights({"w_dst": torch.zeros(2, 8)}))
    assert (e.value.rank, e.value.tensor) == (1, "w")
    with pytest.raises(PlanMismatchError, match="holds no tensor"):
        verify_plan_against_tensors(plan_dst, None, DestinationWeights({}))


def test_keep_staging_reuses_buffers_after_commit_only() -> None:
    dw = DestinationWeights({"w": torch.zeros(4)}, version="v0", keep_staging=True)
    dw.begin("v1")
    first = dw.staged("w", fully_written=True)
    first.fill_(5.0)
    dw.commit()
    dw.begin("v2")
    again = dw.staged("w")  # not fully written: the reused buffer is zeroed
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.zeros(4))
    dw.abort()  # a failed sync's buffers may still be written by a late receive: never reused
    dw.begin("v3")
    assert dw.staged("w").data_ptr() != first.data_ptr()


def test_publish_failure_reaches_the_ranks_latest_connection() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def connect() -> SyncGroup:
        return SyncGroup.connect(store_host="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                                 backend="gloo", timeout_s=10.0, group_name="g")  # fmt: skip

    died = ParticipantDied("died", rank=0, step=SyncStep.TRANSFER).to_failure()
    kw = {"group_name": "g", "world_size": 1, "sync_id": 1, "failure": died}
    assert publish_failure(store, **kw) is False  # nobody joined yet
    old, new = connect(), connect()  # a reconnect: generation 1
    try:
        assert new.begin_sync() == 1
        assert publish_failure(store, **kw) is True
        assert new.peer_failure(1) == died and old.peer_failure(1) is None
        with pytest.raises(PeerFailed, match=r"peer rank 0 failed \(ParticipantDied\): died") as e:
            new.finish(1, timeout_s=5.0, last_round=0)
        assert (e.value.rank, e.value.peer, e.value.reason) == (0, 0, Reason.PEER_FAILED)
    finally:
        old.close()
        new.close()


def test_large_host_staging_is_zeroed_writable_and_outlives_its_mapping() -> None:
    live = torch.ones(3000, 1000, dtype=torch.bfloat16)  # 6 MB: an mmap'd, huge-page buffer
    dw = DestinationWeights({"w": live}, version="v0")
    dw.begin("v1")
    buf = dw.staged("w")
    assert buf.shape == live.shape and buf.dtype == live.dtype and buf.is_contiguous()
    assert not buf.view(torch.int16).any()  # the kernel zeroed it: padding needs no zero pass
    buf[-1, -1] = 2.0
    del buf
    gc.collect()
    dw.staged("w")[0, 0] = 3.0  # the mapping lives as long as the staged tensor
    dw.commit()
    assert live[0, 0] == 3.0 and live[-1, -1] == 2.0 and live[1, 1] == 0.0


class _ClosedPairs:
    """A gloo backend whose pair with rank 3 is closed (that rank's process died): posting an op
    to it raises at once, as gloo does."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, int]] = []

    def _op(self, kind: str, peer: int) -> object:
        if peer == 3:
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:47255")
        self.posted.append((kind, peer))
        return object()

    def recv(self, bufs: list, peer: int, tag: int) -> object:
        return self._op("recv", peer)

    def send(self, bufs: list, peer: int, tag: int) -> object:
        return self._op("send", peer)


def test_posting_to_a_dead_peer_names_that_peer() -> None:
    backend = _ClosedPairs()
    group = SyncGroup(
        store=dist.HashStore(), backend=backend, rank=0, world_size=4, kind="gloo", timeout_s=5, name="g"
    )  # type: ignore[arg-type]
    buf = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ConnectError) as raised:
        group.post([(1, buf, 0), (3, buf, 0)], [(2, buf, 0)])
    assert raised.value.peer == 3 and raised.value.step is SyncStep.TRANSFER
    assert "send to rank 3" in raised.value.message and "Connection closed" in raised.value.message
    assert backend.posted == [("recv", 2), ("send", 1)]  # every irecv first, then the sends in order
    # the control: a round without the dead rank posts every op
    assert len(group.post([(1, buf, 0)], [(2, buf, 0)])) == 2
