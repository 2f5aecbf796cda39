"""Wire forms of a packed program's arrays (core/packed.py).

`flat`/`unflat`: an array as its raw bytes, dtype and shape. numpy's own pickling of an array
costs ~8 us whatever its size (its reduce goes through Python), and a program holds eight small
arrays: pickling all 12,288 programs took 0.75-1.04 s that way, 0.49-0.60 s this way (3 runs each).

`deflate`/`inflate`, the compressed form of a rows block (`compressed`): a header (rows, row
width, names, bytes of the joined names), then zlib of the int32 rows, the int64 per-row byte
counts and the UTF-8 joined names, little-endian. Inflating never reads past what the header
announces and refuses a body that does not match it.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

HEAD = struct.Struct("<4q")
LEVEL = 3
"""zlib level: a receiver's block (~0.9 MB at 12,288 ranks) in ~7 ms, ~10x smaller; level 6
is ~3x slower for 6% less."""


def deflate(rows: np.ndarray, nbytes: np.ndarray, n_names: int, joined: str) -> bytes:
    rows = np.ascontiguousarray(rows, dtype="<i4")
    text = joined.encode()
    body = rows.tobytes() + np.ascontiguousarray(nbytes, dtype="<i8").tobytes() + text
    return HEAD.pack(rows.shape[0], rows.shape[1], n_names, len(text)) + zlib.compress(body, LEVEL)


def inflate(wire: bytes) -> tuple[np.ndarray, np.ndarray, int, str]:
    """(rows int32, per-row bytes int64, names count, joined names) of a `deflate`d block."""
    n_rows, width, n_names, n_text = HEAD.unpack_from(wire)
    size = n_rows * (4 * width + 8) + n_text
    stream = zlib.decompressobj()
    body = stream.decompress(wire[HEAD.size :], max(size, 0) + 1)  # never past its header
    if min(n_rows, width, n_names, n_text) < 0 or len(body) != size or not stream.eof:
        raise ValueError(f"compressed rows block: {len(body)} B does not match its header ({size} B)")
    at = 4 * n_rows * width
    rows = np.frombuffer(body, dtype="<i4", count=n_rows * width).reshape(n_rows, width)
    nbytes = np.frombuffer(body, dtype="<i8", count=n_rows, offset=at)
    # Native-order, writable copies (frombuffer views a read-only bytes object).
    return rows.astype(np.int32), nbytes.astype(np.int64), n_names, body[at + 8 * n_rows :].decode()


def flat(array: np.ndarray) -> tuple[bytes, str, tuple[int, ...]]:
    return array.tobytes(), array.dtype.str, array.shape


def unflat(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The array `flat` gave (read-only: a view of the received bytes; programs only read it)."""
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
