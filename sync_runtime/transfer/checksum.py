"""Position-sensitive checksum of a tensor's raw bytes, computed on the tensor's own device.

The bytes are read as int64 words in blocks of ROWS x COLS words (2 MiB). Per block: its ROWS
row sums and its COLS column sums (mod 2^64: torch's integer addition wraps). The digest is
blake2b over the byte count, every sum, and the bytes no block covers (the last partial row,
the last < 8 bytes). Regions of up to RAW_MAX_BYTES are hashed whole instead. Exact for what a
transfer or a placement gets wrong:
- a changed byte changes one word by 0 < |delta| < 2^64, so its row sum changes;
- any two words of a block differ in row or column. Moving a value from one word to another
  (elements of any width swapped across words or lanes, a piece landed at a shifted offset)
  changes the sum of a row or column they do not share by e * 2^lane, with 0 < |e| < 2^width
  and lane + width <= 64: never 0 mod 2^64 (x <-> -x in the top lanes included, the case a
  weighted sum of words misses). Elements swapped inside one word change that word;
- blake2b binds each sum to its block and position, so changes in different blocks never cancel.
It misses word changes that cancel in every row and column of a block (+x and -x at the four
corners of a rectangle): no single flip, swap or shift does that, and random corruption does it
with negligible probability.
Each set of sums is one vectorized reduction, memory-bound on a CPU (about 2.5x the speed of
the scalar weighted sums of words this replaced). Wrapping integer addition is associative, so
every device and summation order gives the same value: a sender on a GPU and a receiver on a CPU
agree.
"""

from __future__ import annotations

import hashlib
import struct

import torch

ROWS = 512
COLS = 512
BLOCK_WORDS = ROWS * COLS
RAW_MAX_BYTES = 16 * 1024
"""Up to here the bytes themselves go into blake2b: cheaper than a few reductions, and exact."""


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy only when `t` is not contiguous)."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _host_bytes(data: torch.Tensor) -> bytes:
    return data.cpu().numpy().tobytes()


def _word_sums(words: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Row and column sums of the whole blocks, then of the whole rows left; and how many words
    they cover (the rest is hashed as bytes)."""
    blocks = words.numel() // BLOCK_WORDS
    sums = []
    if blocks:
        body = words[: blocks * BLOCK_WORDS].view(blocks, ROWS, COLS)
        sums += [body.sum(2).reshape(-1), body.sum(1).reshape(-1)]
    start = blocks * BLOCK_WORDS
    rows = (words.numel() - start) // COLS
    if rows:
        rest = words[start : start + rows * COLS].view(rows, COLS)
        sums += [rest.sum(1), rest.sum(0)]
    return sums, start + rows * COLS


def checksum_bytes(data: torch.Tensor) -> int:
    """Checksum of a flat uint8 tensor, as a signed 64-bit integer."""
    n = data.numel()
    h = hashlib.blake2b(struct.pack("<q", n), digest_size=8)
    if n <= RAW_MAX_BYTES:
        h.update(_host_bytes(data))
    else:
        if data.storage_offset() % 8:
            data = data.clone()  # the words are read as aligned int64
        sums, covered = _word_sums(data[: n - n % 8].view(torch.int64))
        h.update(_host_bytes(torch.cat(sums).view(torch.uint8)))
        h.update(_host_bytes(data[8 * covered :]))
    return int.from_bytes(h.digest(), "little", signed=True)


def checksum_tensor(t: torch.Tensor) -> int:
    """Checksum of a tensor (or a strided view of one) over its elements in row-major order."""
    return checksum_bytes(raw_bytes(t))


def hex_digest(value: int) -> str:
    return (value & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big").hex()
