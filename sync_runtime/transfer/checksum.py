"""Position-sensitive checksum of a tensor's raw bytes, computed on the tensor's own device.

The bytes are read as int64 words and reduced per chunk of 2^20 words as S = sum_i w_i * k_i
(mod 2^64) with odd per-position weights 0 < k_i < 2^32, twice: S1 over the words at byte
offset 0 (w_i = bytes [8i, 8i+8)) and S2 over the words at byte offset 4. One pass of a
multiply-accumulate per sum, no widening copy: about 3x cheaper than widening int32 words into
an int64 scratch buffer, the scheme this replaces, and still exact:
- a changed byte changes one S1 word by 0 < |delta| < 2^64, and delta * k_i with k_i odd is
  never 0 mod 2^64;
- swapping two 16-bit or 32-bit elements changes S1 by d * (2^a * k_i - 2^b * k_j), where the
  element difference d has at most 15 (31) factors of 2 and a, b are the lane offsets in bits.
  That is nonzero mod 2^64 unless both elements sit in the upper half of their words (a = b >= 32):
  S2 reads those same elements at offsets a - 32 < 32, where the product is again nonzero.
  (One pass over 64-bit words alone cannot work: x <-> -x in the top lanes of two words changes
  S1 by 2^63 * (k_i - k_j), which is 0 for any two odd weights.)
Chunk sums and the last < 12 bytes (which S2's words may not cover) are folded with blake2b, so
changes across chunks are caught too. Wrapping integer addition is associative, so every device
and summation order gives the same value: a sender on a GPU and a receiver on a CPU agree.
"""

from __future__ import annotations

import hashlib
import struct
import threading

import numpy as np
import torch

CHUNK_WORDS = 1 << 20
_MULT = 0x9E3779B1  # Fibonacci hashing constant: spreads consecutive positions over the weight range.
_weights: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()  # the tables are built once per device; a serving thread may call checksums()


def _weights_for(device: torch.device) -> torch.Tensor:
    with _lock:
        if device not in _weights:
            idx = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device)
            _weights[device] = ((idx * _MULT) & 0x7FFFFFFF) * 2 + 1
        return _weights[device]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy only when `t` is not contiguous)."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _offset_words(data: torch.Tensor, count: int, *, portable: bool = False) -> torch.Tensor:
    """`count` int64 words starting at byte 4 of the 8-byte aligned `data`, copy-free on CPU."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if data.device.type == "cpu" and not portable:
        # x86 and arm64 load unaligned words at full speed; torch refuses unaligned dtype views,
        # numpy does not (the array shares `data`'s memory).
        raw = np.frombuffer(data.numpy(), dtype=np.uint8, count=8 * count, offset=4)
        return torch.from_numpy(raw.view(np.int64))
    # Accelerators need aligned loads: rebuild each word from the halves of two aligned words.
    halves = data[: 8 * count + 4].view(torch.int32)
    lo = halves[1 : 2 * count : 2].to(torch.int64) & 0xFFFFFFFF
    return lo | (halves[2 : 2 * count + 1 : 2].to(torch.int64) << 32)


def _weighted_sums(words: torch.Tensor, weights: torch.Tensor) -> list[int]:
    sums = []
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS]
        k = weights[: chunk.numel()]
        if chunk.device.type == "cpu":
            sums.append(int(torch.dot(chunk, k)))  # one fused multiply-accumulate pass, no temporary
        else:
            sums.append(int((chunk * k).sum()))  # CUDA has no integer dot; bandwidth is plentiful there
    return sums


def checksum_bytes(data: torch.Tensor) -> int:
    """Checksum of a flat uint8 tensor, as a signed 64-bit integer."""
    n = data.numel()
    if data.storage_offset() % 8:
        data = data.clone()  # S1 reads aligned int64 words
    n1 = n // 8
    n2 = max(n - 4, 0) // 8
    weights = _weights_for(data.device)
    sums = _weighted_sums(data[: 8 * n1].view(torch.int64), weights)
    sums += _weighted_sums(_offset_words(data, n2), weights)
    # Most checksummed regions are small (norms, biases, small packed pieces): the Python
    # around the two dot products is kept to a few calls.
    tail = data[min(4 + 8 * n2, 8 * n1) :].cpu().numpy().tobytes()
    head = struct.pack(f"<q{len(sums)}q", n, *sums)
    return int.from_bytes(hashlib.blake2b(head + tail, digest_size=8).digest(), "little", signed=True)


def checksum_tensor(t: torch.Tensor) -> int:
    """Checksum of a tensor (or a strided view of one) over its elements in row-major order."""
    return checksum_bytes(raw_bytes(t))


def hex_digest(value: int) -> str:
    return (value & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big").hex()
