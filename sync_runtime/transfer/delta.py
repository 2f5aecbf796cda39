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
Position codecs, the smallest one wins: gaps between consecutive positions as LEB128 varints
(few changes), a bitmap of one bit per element (many changes), or either one through zlib when
that is smaller still (clustered changes compress well; a stream over 64 KiB is tried only when its
first 64 KiB shrink by half).
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


_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)
"""A value below 2^7k fits k varint bytes (integer thresholds: exact where a float log2 is not)."""


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """How many LEB128 bytes each unsigned integer takes (one pass, not one per threshold)."""
    return 1 + np.searchsorted(_VARINT_LIMITS, values.astype(np.uint64, copy=False), side="right")


def encode_varints(values: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """Unsigned integers as LEB128 varints (7 bits a byte, high bit set on all but the last).
    `lengths`: varint_lengths(values), when the caller has them already."""
    v = values.astype(np.uint64, copy=False)
    if v.size == 0:
        return np.empty(0, dtype=np.uint8)
    if lengths is None:
        lengths = varint_lengths(v)
    longest = int(lengths.max())
    if longest == 1:  # every value below 128: the varints are the values' low bytes
        return v.astype(np.uint8)
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    starts = ends - lengths
    out[starts] = ((v & np.uint64(0x7F)) | ((lengths > 1).astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    for k in range(1, longest):
        sel = np.flatnonzero(lengths > k)
        byte = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[sel] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + k] = (byte | more).astype(np.uint8)
    return out


def decode_varints(data: np.ndarray, count: int) -> np.ndarray:
    """The `count` unsigned integers LEB128-encoded in `data` (uint8), exactly; raises if malformed."""
    if count == 0:
        if data.size:
            raise DeltaFormatError("varint stream holds bytes but no values")
        return np.empty(0, dtype=np.uint64)
    last = (data & 0x80) == 0
    ends = np.flatnonzero(last)
    if ends.size != count or ends[-1] != data.size - 1:
        raise DeltaFormatError(f"varint stream holds {ends.size} values, expected {count}")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 10:
        raise DeltaFormatError("varint longer than 10 bytes")
    out = np.zeros(count, dtype=np.uint64)
    for k in range(int(lengths.max())):
        sel = lengths > k
        out[sel] |= (data[starts[sel] + k] & np.uint8(0x7F)).astype(np.uint64) << np.uint64(7 * k)
    return out


ZLIB_MIN_BYTES = 4096
"""zlib only pays for sizable position streams; level 1 keeps it cheap."""
ZLIB_PROBE_BYTES = 64 * 1024
"""A longer stream is compressed whole only when its first this many bytes shrink by half: the
gaps of scattered changes shrink by about a sixth, which saves less wire time than zlib costs on
any link faster than a few MB/s; clustered changes shrink many times over."""


def _positions_codec(positions: np.ndarray, elements: int) -> tuple[int, bytes]:
    """The smallest position stream: varint gaps or a bitmap (sized before either is built, and
    only the smaller one built), through zlib when that is smaller still."""
    gaps = np.diff(positions, prepend=-1).astype(np.uint64) - np.uint64(1)  # first gap: from -1
    lengths = varint_lengths(gaps)
    if int(lengths.sum()) <= (elements + 7) // 8:
        codec, raw = VARINT, encode_varints(gaps, lengths).tobytes()
    else:
        mask = np.zeros(elements, dtype=bool)
        mask[positions] = True
        codec, raw = BITMAP, np.packbits(mask, bitorder="little").tobytes()
    if len(raw) < ZLIB_MIN_BYTES:
        return codec, raw
    probe = raw[:ZLIB_PROBE_BYTES]
    if len(raw) > len(probe) and len(zlib.compress(probe, 1)) > 0.5 * len(probe):
        return codec, raw
    packed = zlib.compress(raw, 1)
    if len(packed) < len(raw):
        return (ZLIB_VARINT if codec == VARINT else ZLIB_BITMAP), packed
    return codec, raw


def _value_candidates(
    b: np.ndarray, n: np.ndarray, positions: np.ndarray, itemsize: int
) -> tuple[int, bytes]:
    """The changed elements' values, PLAIN or XOR8, whichever is smaller (integer ops only)."""
    new_values = n[positions]
    plain = new_values.tobytes()
    if itemsize == 1:
        return PLAIN, plain
    flips = b[positions] ^ new_values
    wide = np.flatnonzero(flips >> np.array(8, dtype=flips.dtype))
    gaps = encode_varints(np.diff(wide, prepend=-1).astype(np.uint64) - np.uint64(1)).tobytes()
    size = positions.size + _WIDE.size + len(gaps) + wide.size * itemsize
    if size >= len(plain):
        return PLAIN, plain
    head = _WIDE.pack(wide.size, len(gaps))
    return XOR8, flips.astype(np.uint8).tobytes() + head + gaps + new_values[wide].tobytes()


def encode(base: np.ndarray, new: np.ndarray, itemsize: int) -> Encoded:
    """Encode `new` against `base` (flat uint8 arrays of equal size): a delta, or dense when the
    delta would not be smaller than the dense message."""
    if base.size != new.size:
        raise ValueError(f"base holds {base.size} bytes, new {new.size}")
    b, n = _as_uint(base, itemsize), _as_uint(new, itemsize)
    positions = np.flatnonzero(b != n)
    elements, changed = n.size, positions.size
    if changed and changed * itemsize < new.size:
        codec, pos = _positions_codec(positions, elements)
        vcodec, values = _value_candidates(b, n, positions, itemsize)
        pad = -len(pos) % itemsize
        total = HEADER_BYTES + len(pos) + pad + len(values)
        if total < max_message_bytes(new.size):
            msg = np.empty(total, dtype=np.uint8)
            _header(msg, DELTA, codec, itemsize, elements, changed, len(pos), vcodec)
            msg[HEADER_BYTES : HEADER_BYTES + len(pos)] = np.frombuffer(pos, dtype=np.uint8)
            msg[HEADER_BYTES + len(pos) : HEADER_BYTES + len(pos) + pad] = 0
            msg[HEADER_BYTES + len(pos) + pad :] = np.frombuffer(values, dtype=np.uint8)
            return Encoded(msg, DELTA, elements, changed)
    if changed == 0:  # nothing changed: a delta of no positions, a header alone
        msg = np.empty(HEADER_BYTES, dtype=np.uint8)
        _header(msg, DELTA, VARINT, itemsize, elements, 0, 0)
        return Encoded(msg, DELTA, elements, 0)
    return encode_dense(new, itemsize, changed)


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
    positions = _positions(body[:pos_nbytes].tobytes(), codec, changed, elements)
    values = _values(body[pos_nbytes + pad :], vcodec, changed, itemsize)
    words = out.view(_UINT[itemsize])
    if vcodec == XOR8:
        flips, wide, wide_values = values
        new_values = base.view(_UINT[itemsize])[positions] ^ flips.astype(words.dtype)
        new_values[wide] = wide_values
    else:
        new_values = values[0]
    if out is not base:
        out[:] = base
    words[positions] = new_values
    return int(changed)


def _values(raw: np.ndarray, vcodec: int, changed: int, itemsize: int) -> tuple[np.ndarray, ...]:
    """PLAIN: (new values,); XOR8: (low-byte flips, wide indices, wide new values)."""
    dtype = _UINT[itemsize]
    if vcodec == PLAIN:
        if raw.size != changed * itemsize:
            raise DeltaFormatError(f"{raw.size} value bytes for {changed} changed elements")
        return (np.frombuffer(raw.tobytes(), dtype=dtype),)
    if vcodec != XOR8 or itemsize == 1 or raw.size < changed + _WIDE.size:
        raise DeltaFormatError(f"bad value section (codec {vcodec}, {raw.size} bytes)")
    flips = raw[:changed]
    n_wide, gap_bytes = _WIDE.unpack(raw[changed : changed + _WIDE.size].tobytes())
    at = changed + _WIDE.size
    if n_wide > changed or raw.size != at + gap_bytes + n_wide * itemsize:
        raise DeltaFormatError(f"bad XOR8 section ({n_wide} wide of {changed}, {raw.size} bytes)")
    gaps = decode_varints(raw[at : at + gap_bytes], n_wide)
    wide = (np.cumsum(gaps + np.uint64(1)) - np.uint64(1)).astype(np.int64)
    if n_wide and wide[-1] >= changed:
        raise DeltaFormatError("XOR8 wide index out of range")
    return flips, wide, np.frombuffer(raw[at + gap_bytes :].tobytes(), dtype=dtype)


def _positions(raw: bytes, codec: int, changed: int, elements: int) -> np.ndarray:
    try:
        if codec in (ZLIB_VARINT, ZLIB_BITMAP):
            raw = zlib.decompress(raw)
            codec -= 2
    except zlib.error as e:
        raise DeltaFormatError(f"delta positions do not decompress: {e}") from e
    data = np.frombuffer(raw, dtype=np.uint8)
    if codec == VARINT:
        gaps = decode_varints(data, changed)
        positions = (np.cumsum(gaps + np.uint64(1)) - np.uint64(1)).astype(np.int64)
    elif codec == BITMAP:
        if data.size != (elements + 7) // 8:
            raise DeltaFormatError(f"bitmap of {data.size} bytes for {elements} elements")
        positions = np.flatnonzero(np.unpackbits(data, count=elements, bitorder="little"))
    else:
        raise DeltaFormatError(f"unknown position codec {codec}")
    if positions.size != changed or (changed and (positions[-1] >= elements or positions[0] < 0)):
        raise DeltaFormatError(f"delta positions out of range for {elements} elements")
    return positions
