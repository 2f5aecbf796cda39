"""Lossless delta encoding of one transfer's bytes against the bytes the receiver already holds.

Weights are compared as integer bit patterns of their element width (uint16 for bf16/fp16,
uint32 for fp32, uint8 for one-byte dtypes), never as floats: a sign flip, -0.0 vs +0.0 and two
NaNs with different payloads are changes like any other, and decoding writes the new bit
patterns unchanged, so decode(encode(base, new), base) == new byte for byte.

Message layout (little-endian), self-describing so the receiver needs only an upper bound of
its size (`max_message_bytes`) to post its receive:
- a 40-byte header: magic, kind (dense or delta), position codec, element size, then the
  element count, the changed count, the position bytes and the message's total length;
- dense: the new bytes, whole (what a delta falls back to when it would not be smaller);
- delta: the changed positions (codec below), padded to the element size, then the values of
  the changed elements in position order: PLAIN, the new values; or XOR8, when smaller: one byte
  per changed element, the low byte of old XOR new (a step of a few ulps changes only the low
  mantissa bits), then the elements whose change reaches higher bits (their index among the
  changed as varint gaps, then their new values whole).
Position codecs, the smaller one wins: gaps between consecutive positions as LEB128 varints
(few changes) or a bitmap of one bit per element (many changes). The format also defines both
through zlib (ZLIB_VARINT, ZLIB_BITMAP), which the decoder reads; the encoder no longer writes
them: zlib at level 1 takes ~2-5 ns per byte, so it saves wall time only on links slower than a
few hundred MB/s, and it was a sixth of the encoding time on the loopback benchmark.

Cost: the compare runs on 8-byte words (a scan for nonzero over a quarter as many entries for
bf16), and only the changed words are split into elements; everything after works on arrays of
the changed elements' size. No Python loop runs per element or per varint byte.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = 0x444C5441  # "DLTA"
HEADER = struct.Struct("<IBBBBQQQ")  # magic, kind, codec, itemsize, values, elements, changed, pos_nbytes
HEADER_BYTES = HEADER.size + 8  # 40: HEADER, then the total length
DENSE, DELTA = 0, 1
VARINT, BITMAP, ZLIB_VARINT, ZLIB_BITMAP = 0, 1, 2, 3
PLAIN, XOR8 = 0, 1
_WIDE = struct.Struct("<QQ")  # XOR8: elements whose change reaches past the low byte, their gap bytes
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaFormatError(ValueError):
    """A message that is not a well-formed delta for the given base (corrupted or mismatched)."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded transfer: the message to send and what it says about the change."""

    message: np.ndarray
    """uint8, the whole wire message (header included)."""
    kind: int
    elements: int
    changed: int

    @property
    def nbytes(self) -> int:
        return int(self.message.size)


def max_message_bytes(nbytes: int) -> int:
    """The largest message `encode` produces for `nbytes` of new data (a dense one)."""
    return nbytes + HEADER_BYTES


def _as_uint(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize not in _UINT:
        raise ValueError(f"element size {itemsize}: must be 1, 2, 4 or 8")
    if data.dtype != np.uint8 or data.ndim != 1 or data.size % itemsize:
        raise ValueError(
            f"expected flat uint8 bytes, a multiple of {itemsize}; got {data.dtype} {data.shape}"
        )
    return data.view(_UINT[itemsize])


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """How many LEB128 bytes each unsigned integer takes: one compare pass per byte that the
    largest value needs beyond the first (integer thresholds: exact where a float log2 is not)."""
    v = values.astype(np.uint64, copy=False)
    lengths = np.ones(v.size, dtype=np.intp)
    top = int(v.max()) if v.size else 0
    k = 1
    while k < 10 and top >> (7 * k):
        lengths += v >= np.uint64(1 << (7 * k))
        k += 1
    return lengths


def encode_varints(values: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """Unsigned integers as LEB128 varints (7 bits a byte, high bit set on all but the last).
    `lengths`: varint_lengths(values), when the caller has them already."""
    v = values.astype(np.uint64, copy=False)
    if v.size == 0:
        return np.empty(0, dtype=np.uint8)
    if lengths is None:
        lengths = varint_lengths(v)
    first = (v & np.uint64(0x7F)).astype(np.uint8)
    longest = int(lengths.max())
    if longest == 1:  # every value below 128: the varints are the values' low bytes
        return first
    first |= (lengths > 1).view(np.uint8) << 7
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    starts = ends - lengths
    out[starts] = first
    for k in range(1, longest):  # the few longer values only
        sel = np.flatnonzero(lengths > k)
        byte = ((v.take(sel) >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= (lengths.take(sel) > k + 1).view(np.uint8) << 7
        out[starts.take(sel) + k] = byte
    return out


def decode_varints(data: np.ndarray, count: int) -> np.ndarray:
    """The `count` unsigned integers LEB128-encoded in `data` (uint8), exactly; raises if malformed."""
    if count == 0:
        if data.size:
            raise DeltaFormatError("varint stream holds bytes but no values")
        return np.empty(0, dtype=np.uint64)
    ends = np.flatnonzero(data < 0x80)
    if ends.size != count or ends[-1] != data.size - 1:
        raise DeltaFormatError(f"varint stream holds {ends.size} values, expected {count}")
    if count == data.size:  # every value one byte
        return data.astype(np.uint64)
    starts = np.empty(count, dtype=np.intp)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest > 10:
        raise DeltaFormatError("varint longer than 10 bytes")
    out = (data.take(starts) & np.uint8(0x7F)).astype(np.uint64)
    for k in range(1, longest):  # the few longer values only
        sel = np.flatnonzero(lengths > k)
        more = (data.take(starts.take(sel) + k) & np.uint8(0x7F)).astype(np.uint64)
        out[sel] |= more << np.uint64(7 * k)
    return out


def changed_elements(b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, old XOR new) of the elements whose bits differ, `b` and `n` of one unsigned
    dtype. Narrow elements are compared 8 bytes at a time first: a scan for nonzero over a quarter
    as many words (bf16) is what makes this cheap, and only the few changed words are split into
    their elements. Integer compares only: -0.0, NaN payloads and sign flips are changes."""
    lanes = 8 // b.itemsize
    if lanes == 1:
        positions = np.flatnonzero(b != n)
        return positions, b.take(positions) ^ n.take(positions)
    whole = b.size - b.size % lanes
    bw, nw = b[:whole].view(np.uint64), n[:whole].view(np.uint64)
    words = np.flatnonzero(bw != nw)
    xor = (bw.take(words) ^ nw.take(words)).view(b.dtype)  # the changed words' lanes, in memory order
    inner = np.flatnonzero(xor != 0)
    shift = lanes.bit_length() - 1
    positions = (words.take(inner >> shift) << shift) | (inner & (lanes - 1))
    flips = xor.take(inner)
    if whole < b.size:  # the last elements, fewer than a word
        rest = np.flatnonzero(b[whole:] != n[whole:]) + whole
        positions = np.concatenate((positions, rest))
        flips = np.concatenate((flips, b.take(rest) ^ n.take(rest)))
    return positions, flips


def encode(base: np.ndarray, new: np.ndarray, itemsize: int) -> Encoded:
    """Encode `new` against `base` (flat uint8 arrays of equal size): a delta, or dense when the
    delta would not be smaller than the dense message."""
    if base.size != new.size:
        raise ValueError(f"base holds {base.size} bytes, new {new.size}")
    b, n = _as_uint(base, itemsize), _as_uint(new, itemsize)
    positions, flips = changed_elements(b, n)
    elements, changed = n.size, positions.size
    if changed == 0:  # nothing changed: a delta of no positions, a header alone
        msg = np.empty(HEADER_BYTES, dtype=np.uint8)
        _header(msg, DELTA, VARINT, itemsize, elements, 0, 0)
        return Encoded(msg, DELTA, elements, 0)
    if changed * itemsize >= new.size:
        return encode_dense(new, itemsize, changed)
    gaps = np.diff(positions, prepend=-1).astype(np.uint64) - np.uint64(1)  # first gap: from -1
    lengths = varint_lengths(gaps)
    pos_nbytes = int(lengths.sum())
    codec = VARINT if pos_nbytes <= (elements + 7) // 8 else BITMAP
    if codec == BITMAP:
        pos_nbytes = (elements + 7) // 8
    values = _Values.of(flips, itemsize)
    pad = -pos_nbytes % itemsize
    total = HEADER_BYTES + pos_nbytes + pad + values.nbytes
    if total >= max_message_bytes(new.size):
        return encode_dense(new, itemsize, changed)
    msg = np.empty(total, dtype=np.uint8)
    _header(msg, DELTA, codec, itemsize, elements, changed, pos_nbytes, values.codec)
    body = msg[HEADER_BYTES:]
    if codec == VARINT:
        body[:pos_nbytes] = encode_varints(gaps, lengths)
    else:
        mask = np.zeros(elements, dtype=bool)
        mask[positions] = True
        body[:pos_nbytes] = np.packbits(mask, bitorder="little")
    body[pos_nbytes : pos_nbytes + pad] = 0
    values.write(body[pos_nbytes + pad :], n, positions)
    return Encoded(msg, DELTA, elements, changed)


@dataclass(frozen=True, slots=True)
class _Values:
    """The value section of a delta: PLAIN (the new values) or XOR8 (when smaller: the low byte
    of old XOR new per changed element, then the elements whose change reaches higher bits as
    varint gaps of their index among the changed, then their new values whole)."""

    codec: int
    nbytes: int
    wide: np.ndarray
    wide_gaps: np.ndarray
    flips: np.ndarray

    @classmethod
    def of(cls, flips: np.ndarray, itemsize: int) -> _Values:
        plain = flips.size * itemsize
        if itemsize == 1:
            return cls(PLAIN, plain, flips[:0], np.empty(0, dtype=np.uint8), flips)
        wide = np.flatnonzero(flips >> np.array(8, dtype=flips.dtype))
        gaps = encode_varints(np.diff(wide, prepend=-1).astype(np.uint64) - np.uint64(1))
        xor8 = flips.size + _WIDE.size + gaps.size + wide.size * itemsize
        if xor8 >= plain:
            return cls(PLAIN, plain, wide, gaps, flips)
        return cls(XOR8, xor8, wide, gaps, flips)

    def write(self, out: np.ndarray, n: np.ndarray, positions: np.ndarray) -> None:
        """Write the section into `out` (uint8, exactly `nbytes`); `n`: the new elements."""
        if self.codec == PLAIN:
            out.view(n.dtype)[:] = n.take(positions)
            return
        count, at = self.flips.size, self.flips.size + _WIDE.size
        out[:count] = self.flips  # assigned into uint8: the low bytes
        _WIDE.pack_into(out.data, count, self.wide.size, self.gaps_nbytes)  # type: ignore[arg-type]
        out[at : at + self.gaps_nbytes] = self.wide_gaps
        out[at + self.gaps_nbytes :].view(n.dtype)[:] = n.take(positions.take(self.wide))

    @property
    def gaps_nbytes(self) -> int:
        return int(self.wide_gaps.size)


def encode_dense(new: np.ndarray, itemsize: int, changed: int = 0) -> Encoded:
    """The dense message: the new bytes whole (a sender without the receiver's base sends this)."""
    elements = _as_uint(new, itemsize).size
    msg = np.empty(max_message_bytes(new.size), dtype=np.uint8)
    _header(msg, DENSE, VARINT, itemsize, elements, changed, 0)
    msg[HEADER_BYTES:] = new
    return Encoded(msg, DENSE, elements, changed)


def word_size(element_size: int) -> int:
    """The integer width a dtype's elements are compared in (its own, or the widest dividing it)."""
    return next(w for w in (8, 4, 2, 1) if element_size % w == 0 and w <= element_size)


def _header(
    msg: np.ndarray,
    kind: int,
    codec: int,
    itemsize: int,
    elements: int,
    changed: int,
    pos: int,
    vcodec: int = 0,
) -> None:
    HEADER.pack_into(msg.data, 0, MAGIC, kind, codec, itemsize, vcodec, elements, changed, pos)  # type: ignore[arg-type]
    struct.pack_into("<Q", msg.data, HEADER.size, msg.size)  # type: ignore[arg-type]


def message_length(message: np.ndarray) -> int:
    """The length the header declares (a receive buffer may be larger than the message)."""
    if message.size < HEADER_BYTES:
        raise DeltaFormatError(f"message of {message.size} bytes is shorter than its header")
    magic = struct.unpack_from("<I", message.data, 0)[0]  # type: ignore[arg-type]
    if magic != MAGIC:
        raise DeltaFormatError(f"bad delta magic {magic:#x}")
    (length,) = struct.unpack_from("<Q", message.data, HEADER.size)  # type: ignore[arg-type]
    if not HEADER_BYTES <= length <= message.size:
        raise DeltaFormatError(f"declared length {length} outside [{HEADER_BYTES}, {message.size}]")
    return int(length)


def decode(message: np.ndarray, base: np.ndarray, out: np.ndarray) -> int:
    """Write the new bytes into `out` (flat uint8, base's size; may be `base` itself); the number
    of changed elements. Raises DeltaFormatError for a message that does not fit `base`."""
    length = message_length(message)
    _magic, kind, codec, itemsize, vcodec, elements, changed, pos_nbytes = HEADER.unpack_from(message.data, 0)  # type: ignore[arg-type]
    if itemsize not in _UINT or elements * itemsize != base.size or out.size != base.size:
        raise DeltaFormatError(f"message for {elements} x {itemsize} bytes, base holds {base.size}")
    body = message[HEADER_BYTES:length]
    if kind == DENSE:
        if body.size != base.size:
            raise DeltaFormatError(f"dense message of {body.size} bytes for {base.size}")
        out[:] = body
        return int(changed)
    if kind != DELTA or changed > elements:
        raise DeltaFormatError(f"bad delta header (kind {kind}, {changed} of {elements} changed)")
    pad = -pos_nbytes % itemsize
    if body.size < pos_nbytes + pad:
        raise DeltaFormatError(f"delta body of {body.size} bytes does not match its header")
    positions = _positions(body[:pos_nbytes], codec, changed, elements)
    values = _values(body[pos_nbytes + pad :], vcodec, changed, itemsize)
    words = out.view(_UINT[itemsize])
    if vcodec == XOR8:
        flips, wide, wide_values = values
        new_values = base.view(words.dtype).take(positions)
        new_values ^= flips  # the low byte; the wide ones are replaced whole below
        new_values[wide] = wide_values
    else:
        new_values = values[0]
    if out is not base:
        np.copyto(out, base)  # one pass over the region; only the changed elements are written after
    words[positions] = new_values
    return int(changed)


def _values(raw: np.ndarray, vcodec: int, changed: int, itemsize: int) -> tuple[np.ndarray, ...]:
    """PLAIN: (new values,); XOR8: (low-byte flips, wide indices, wide new values)."""
    dtype = _UINT[itemsize]
    if vcodec == PLAIN:
        if raw.size != changed * itemsize:
            raise DeltaFormatError(f"{raw.size} value bytes for {changed} changed elements")
        return (raw.view(dtype),)
    if vcodec != XOR8 or itemsize == 1 or raw.size < changed + _WIDE.size:
        raise DeltaFormatError(f"bad value section (codec {vcodec}, {raw.size} bytes)")
    flips = raw[:changed]
    n_wide, gap_bytes = _WIDE.unpack_from(raw.data, changed)  # type: ignore[arg-type]
    at = changed + _WIDE.size
    if n_wide > changed or raw.size != at + gap_bytes + n_wide * itemsize:
        raise DeltaFormatError(f"bad XOR8 section ({n_wide} wide of {changed}, {raw.size} bytes)")
    wide = _running(decode_varints(raw[at : at + gap_bytes], n_wide), changed, "XOR8 wide index")
    return flips, wide, raw[at + gap_bytes :].view(dtype)


def _running(gaps: np.ndarray, limit: int, what: str) -> np.ndarray:
    """Indices from varint gaps (each index is the previous one plus its gap plus one), all below
    `limit`: a gap that large would wrap the uint64 sum, so it is refused first."""
    if gaps.size and int(gaps.max()) >= limit:
        raise DeltaFormatError(f"{what} out of range")
    gaps += np.uint64(1)
    out = np.cumsum(gaps).view(np.int64)
    out -= 1
    if gaps.size and out[-1] >= limit:
        raise DeltaFormatError(f"{what} out of range")
    return out


def _positions(raw: np.ndarray, codec: int, changed: int, elements: int) -> np.ndarray:
    data = raw
    if codec in (ZLIB_VARINT, ZLIB_BITMAP):  # the format allows it; this encoder no longer sends it
        try:
            data = np.frombuffer(zlib.decompress(raw.tobytes()), dtype=np.uint8)
        except zlib.error as e:
            raise DeltaFormatError(f"delta positions do not decompress: {e}") from e
        codec -= 2
    if codec == VARINT:
        positions = _running(decode_varints(data, changed), elements, "delta positions")
    elif codec == BITMAP:
        if data.size != (elements + 7) // 8:
            raise DeltaFormatError(f"bitmap of {data.size} bytes for {elements} elements")
        positions = np.flatnonzero(np.unpackbits(data, count=elements, bitorder="little"))
    else:
        raise DeltaFormatError(f"unknown position codec {codec}")
    if positions.size != changed or (changed and (positions[-1] >= elements or positions[0] < 0)):
        raise DeltaFormatError(f"delta positions out of range for {elements} elements")
    return positions
