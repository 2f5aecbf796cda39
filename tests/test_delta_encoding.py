"""Delta encoding (sync_runtime/transfer/delta.py): exact at the bit level, smallest of its codecs."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sync_runtime.core.plan import Transfer
from sync_runtime.transfer import delta
from sync_runtime.transfer.checksum import checksum_bytes
from sync_runtime.transfer.delta_wire import DeltaIO, KeptBits

pytestmark = pytest.mark.unit

ITEMSIZES = st.sampled_from([1, 2, 4, 8])


@st.composite
def base_and_new(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """A base and a new version of the same bytes; changes anywhere from none to all elements."""
    itemsize = draw(ITEMSIZES)
    elements = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, elements * itemsize, dtype=np.uint8)
    new = base.copy()
    fraction = draw(st.sampled_from([0.0, 0.001, 0.03, 0.2, 0.5, 0.9, 1.0]))
    changed = rng.random(elements) < fraction
    words = new.view(delta._UINT[itemsize])
    flips = rng.integers(1, 256, int(changed.sum()), dtype=np.uint8).astype(words.dtype)
    # Low byte (a few ulps: XOR8 values) or top byte (sign and exponent: whole values), mixed.
    top = rng.random(flips.size) < draw(st.sampled_from([0.0, 0.01, 0.5, 1.0]))
    shifts = np.where(top, 8 * (itemsize - 1), 0).astype(words.dtype)
    words[changed] ^= flips << shifts
    return base, new, itemsize


def _roundtrip(base: np.ndarray, new: np.ndarray, itemsize: int) -> delta.Encoded:
    enc = delta.encode(base, new, itemsize)
    out = np.empty_like(base)
    assert delta.decode(enc.message, base, out) == enc.changed
    assert out.tobytes() == new.tobytes()
    assert enc.nbytes <= delta.max_message_bytes(new.size)
    return enc


@given(base_and_new())
@settings(max_examples=300, deadline=None)
def test_decode_of_encode_is_the_new_bytes(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    base, new, itemsize = case
    enc = _roundtrip(base, new, itemsize)
    words_b, words_n = base.view(delta._UINT[itemsize]), new.view(delta._UINT[itemsize])
    assert enc.changed == int((words_b != words_n).sum())
    # a larger receive buffer (the receiver's upper bound) decodes the same
    padded = np.zeros(delta.max_message_bytes(new.size) + 64, dtype=np.uint8)
    padded[: enc.nbytes] = enc.message
    out = np.empty_like(base)
    delta.decode(padded, base, out)
    assert out.tobytes() == new.tobytes()


@given(st.lists(st.integers(0, 2**64 - 1), max_size=200))
def test_varints_roundtrip_exactly(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    assert delta.decode_varints(delta.encode_varints(arr), len(values)).tolist() == values


@given(st.lists(st.integers(0, 2**64 - 1), max_size=200))
def test_varint_lengths_are_the_encoded_lengths(values: list[int]) -> None:
    """The sizes the codec choice is made on (before any stream is built) are the real ones."""
    arr = np.array(values, dtype=np.uint64)
    lengths = delta.varint_lengths(arr)
    assert [len(delta.encode_varints(np.array([v], dtype=np.uint64))) for v in values] == lengths.tolist()
    assert int(lengths.sum()) == len(delta.encode_varints(arr, lengths))


def test_the_encoder_sends_no_zlib_and_the_decoder_still_reads_it() -> None:
    """zlib costs more encoding time than it saves on any fast link: runs of changes go as a plain
    bitmap or varint gaps now. The format still defines the zlib codecs, and a message using one
    decodes to the same bytes (a peer's encoder may send it)."""
    n = 1 << 20
    base = np.zeros(2 * n, dtype=np.uint8)
    rng = np.random.default_rng(3)
    runs = base.copy()
    runs.view(np.uint16)[rng.random(n // 64).repeat(64) < 0.03] = 1  # 3% of the elements, in runs of 64
    enc = _roundtrip(base, runs, 2)
    assert enc.message[5] in (delta.VARINT, delta.BITMAP)
    pos_nbytes = int(enc.message[24:32].view(np.uint64)[0])
    positions = enc.message[delta.HEADER_BYTES : delta.HEADER_BYTES + pos_nbytes].tobytes()
    packed = zlib.compress(positions, 1)
    assert len(packed) < len(positions) / 4  # control: zlib would shrink these positions
    rest = enc.message[delta.HEADER_BYTES + pos_nbytes + (-pos_nbytes % 2) :]
    pad = bytes(-len(packed) % 2)
    body = np.frombuffer(packed + pad + rest.tobytes(), dtype=np.uint8)
    message = np.empty(delta.HEADER_BYTES + body.size, dtype=np.uint8)
    message[: delta.HEADER_BYTES] = enc.message[: delta.HEADER_BYTES]
    message[delta.HEADER_BYTES :] = body
    message[5] += 2  # VARINT -> ZLIB_VARINT, BITMAP -> ZLIB_BITMAP
    message[24:32] = np.array([len(packed)], dtype=np.uint64).view(np.uint8)
    message[32:40] = np.array([message.size], dtype=np.uint64).view(np.uint8)
    out = np.empty_like(base)
    assert delta.decode(message, base, out) == enc.changed
    assert out.tobytes() == runs.tobytes()
    message[delta.HEADER_BYTES] ^= 0xFF  # a corrupted zlib stream is refused, not guessed at
    with pytest.raises(delta.DeltaFormatError):
        delta.decode(message, base, out)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("elements", [0, 1, 3, 7, 8, 9, 33, 1000])
@pytest.mark.parametrize("offset", [0, 1])
def test_changed_elements_are_every_differing_element(itemsize: int, elements: int, offset: int) -> None:
    """The word-wise compare finds exactly the elements whose bits differ, in order, with their
    XOR: counts that are not a multiple of a word's elements (the tail compared one by one),
    arrays that do not start on a word boundary, and changes in any lane and any bit."""
    rng = np.random.default_rng(elements * 10 + itemsize + offset)
    dtype = delta._UINT[itemsize]
    raw_b = rng.integers(0, 256, (elements + offset) * itemsize, dtype=np.uint8)
    raw_n = raw_b.copy()
    b = raw_b[offset * itemsize :].view(dtype)
    n = raw_n[offset * itemsize :].view(dtype)
    for fraction in (0.0, 0.05, 0.5, 1.0):
        n[:] = b
        hit = rng.random(elements) < fraction
        bits = rng.integers(0, 8 * itemsize, elements).astype(dtype)
        n[hit] ^= np.ones(1, dtype=dtype) << bits[hit]  # one bit anywhere in the element
        positions, flips = delta.changed_elements(b, n)
        assert positions.tolist() == np.flatnonzero(hit).tolist()
        assert flips.tolist() == (b[hit] ^ n[hit]).tolist()
    positions, flips = delta.changed_elements(b, b.copy())
    assert positions.size == 0 and flips.size == 0


def _bits16(values: list[float]) -> np.ndarray:
    return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint8).numpy().copy()


def test_float_special_values_are_changes_like_any_other() -> None:
    """-0.0/+0.0, sign flips and NaNs with different payloads differ as bits: all carried exactly."""
    base = _bits16([0.0, 1.0, 2.0, 3.0] * 64)
    new = base.copy()
    words = new.view(np.uint16)
    words[0] = 0x8000  # -0.0 where +0.0 was: equal as floats, a change as bits
    words[1] ^= 0x8000  # 1.0 -> -1.0
    words[2] = 0x7FC1  # a NaN
    base.view(np.uint16)[3] = 0x7FC2  # base holds another NaN payload...
    words[3] = 0x7FC3  # ...replaced by a third: NaN != NaN as floats, still a change
    enc = _roundtrip(base, new, 2)
    assert enc.kind == delta.DELTA and enc.changed == 4
    f32 = np.array([0.0, np.nan, 1.5], dtype=np.float32).view(np.uint8).copy()
    g32 = f32.copy()
    g32.view(np.uint32)[1] = 0x7FC00001  # a NaN with another payload
    g32.view(np.uint32)[0] = 0x80000000
    assert _roundtrip(f32, g32, 4).changed == 2


def test_none_changed_is_a_header_and_all_changed_is_dense() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 4096, dtype=np.uint8)
    enc = _roundtrip(base, base.copy(), 2)
    assert (enc.kind, enc.changed, enc.nbytes) == (delta.DELTA, 0, delta.HEADER_BYTES)
    enc = _roundtrip(base, base ^ np.uint8(1), 2)
    assert (enc.kind, enc.changed) == (delta.DENSE, 2048)
    assert enc.nbytes == delta.max_message_bytes(base.size)


def test_codec_is_the_smallest() -> None:
    """Few scattered changes travel as varint gaps, many as a bitmap (whichever is smaller)."""
    n = 1 << 16
    base = np.zeros(2 * n, dtype=np.uint8)
    sparse = base.copy()
    sparse.view(np.uint16)[::1000] = 1
    enc = _roundtrip(base, sparse, 2)
    assert (enc.message[5], enc.message[7]) == (delta.VARINT, delta.XOR8)
    # 2-byte gaps, then one low byte per change and an empty list of wide changes
    assert enc.nbytes == delta.HEADER_BYTES + 66 * 2 + 66 + 16
    wide = sparse.copy()
    wide.view(np.uint16)[::1000] = 0x8000  # sign bits: every change is wide, whole values win
    enc = _roundtrip(base, wide, 2)
    assert enc.message[7] == delta.PLAIN and enc.nbytes == delta.HEADER_BYTES + 66 * 2 + 66 * 2
    rng = np.random.default_rng(1)
    small = np.zeros(2 * 8192, dtype=np.uint8)  # a 1 KiB bitmap: below zlib's threshold
    dense_ish = small.copy()
    dense_ish.view(np.uint16)[rng.random(8192) < 0.3] = 1
    assert _roundtrip(small, dense_ish, 2).message[5] == delta.BITMAP
    runs = base.copy()
    runs.view(np.uint16)[: n // 4] = 1  # one block: n/4 varint gaps of 0 are larger than the bitmap
    enc = _roundtrip(base, runs, 2)
    assert enc.message[5] == delta.BITMAP and enc.nbytes == delta.HEADER_BYTES + n // 8 + n // 4 + 16


def test_wrong_base_fails_the_checksum() -> None:
    """Negative control: a delta decoded onto another base gives bytes whose checksum is not the
    new tensor's, so the receiver's per-tensor verification refuses them."""
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, 8192, dtype=np.uint8)
    new = base.copy()
    new.view(np.uint16)[rng.random(4096) < 0.02] ^= 0x0101
    enc = delta.encode(base, new, 2)
    assert enc.kind == delta.DELTA
    wrong = base.copy()
    wrong.view(np.uint16)[7] ^= 0x0001  # one unchanged element differs in the receiver's base
    out = np.empty_like(base)
    delta.decode(enc.message, wrong, out)
    want = checksum_bytes(torch.from_numpy(new))
    assert checksum_bytes(torch.from_numpy(out)) != want
    delta.decode(enc.message, base, out)
    assert checksum_bytes(torch.from_numpy(out)) == want


def test_malformed_messages_are_refused() -> None:
    base = np.zeros(64, dtype=np.uint8)
    new = base.copy()
    new[3] = 9
    enc = delta.encode(base, new, 2)
    out = np.empty_like(base)
    with pytest.raises(delta.DeltaFormatError, match="base holds"):
        delta.decode(enc.message, np.zeros(66, dtype=np.uint8), np.empty(66, dtype=np.uint8))
    bad = enc.message.copy()
    bad[0] ^= 1
    with pytest.raises(delta.DeltaFormatError, match="magic"):
        delta.decode(bad, base, out)
    with pytest.raises(delta.DeltaFormatError, match="shorter"):
        delta.decode(enc.message[:10], base, out)
    far = enc.message.copy()  # one change, at element 1 (byte 3): its gap is the first position byte
    assert far[delta.HEADER_BYTES] == 1
    far[delta.HEADER_BYTES] = 32  # a position past the 32 elements
    with pytest.raises(delta.DeltaFormatError, match="out of range"):
        delta.decode(far, base, out)
    far[delta.HEADER_BYTES] = 31  # control: the last element is in range
    delta.decode(far, base, out)
    assert out.view(np.uint16)[31] == 9 << 8 and out.view(np.uint16)[:31].tolist() == [0] * 31


def test_a_kept_copy_of_another_shape_or_version_is_no_base() -> None:
    """The source sends dense messages unless its kept copy is of the receiver's base version and
    of the tensor's current shape and dtype (a layout change keeps names, not shapes)."""
    old = torch.arange(64, dtype=torch.int16).view(torch.bfloat16).reshape(8, 8)
    new = old.clone()
    new.view(torch.int16)[0, 0] ^= 1
    box = ((0, 8), (0, 8))
    t = Transfer(
        src_rank=0, dst_rank=1, tensor="w", src_name="w", src_box=box, dst_name="w", dst_box=box, nbytes=128
    )
    kinds = []
    for kept_tensor, version in [(old, "v1"), (old, "v0"), (old.reshape(4, 16), "v1"), (old.float(), "v1")]:
        kept = KeptBits()
        kept.record({"w": kept_tensor}, version)
        io = DeltaIO({1: "v1"}, kept)
        message = io.encode(t, 1, new.reshape(-1).view(torch.uint8), new)
        kinds.append(int(message[4]))
        out = np.empty(128, dtype=np.uint8)
        delta.decode(message.numpy(), old.reshape(-1).view(torch.uint8).numpy(), out)
        assert out.tobytes() == new.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert kinds == [delta.DELTA, delta.DENSE, delta.DENSE, delta.DENSE]
