"""The source fence: proof that no source tensor changed while a sync read it.

A fingerprint per tensor is taken before the first byte is read and compared after the last:
- `data_ptr`: the tensor was not reallocated (an optimizer that swaps buffers);
- `_version`: torch's version counter, bumped by every in-place op through the tensor or any
  view of it (`copy_`, `add_`, an optimizer step); free to read;
- a checksum of sampled bytes (both ends and evenly spaced blocks): catches writes that bypass
  the counter (through `.data`, numpy, a CUDA kernel of another library), though only where
  they touch a sampled block. A full checksum would catch every write but costs a pass over the
  weights; the engine already checksums every byte it sends, against the bytes it sent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sync_runtime.errors import SourceChanged
from sync_runtime.transfer.checksum import checksum_bytes

_SAMPLES = 16
_BLOCK = 64
Fingerprint = tuple[int, int, int]


def _sample(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        return 0  # a strided view: the counter and the pointer still guard it
    flat = t.detach().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n <= _SAMPLES * _BLOCK:
        return checksum_bytes(flat)
    step = (n - _BLOCK) // (_SAMPLES - 1)
    starts = torch.arange(_SAMPLES, device=flat.device) * step
    idx = (starts[:, None] + torch.arange(_BLOCK, device=flat.device)[None, :]).reshape(-1)
    return checksum_bytes(flat[idx])


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
    return {name: (t.data_ptr(), t._version, _sample(t)) for name, t in tensors.items()}


def check_fence(before: Mapping[str, Fingerprint], tensors: Mapping[str, torch.Tensor], rank: int) -> None:
    """Raise SourceChanged naming the first tensor whose fingerprint moved."""
    for name, t in tensors.items():
        was = before.get(name)
        now = (t.data_ptr(), t._version, _sample(t))
        if was != now:
            what = "was reallocated" if was is None or was[0] != now[0] else "was written"
            raise SourceChanged(
                f"rank {rank}: source tensor {name!r} {what} during the sync (a training step ran "
                "while its shards were read); no destination commits these bytes",
                rank=rank,
                tensor=name,
            )


def snapshot(tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Host copies of the source shards (pinned when they live on CUDA), fenced themselves: once
    this returns, the trainer may step while the sync sends the copies."""
    before = fingerprint(tensors)
    out = {}
    for name, t in tensors.items():
        pinned = t.device.type == "cuda"
        copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        copy.copy_(t.detach(), non_blocking=pinned)
        out[name] = copy
    if any(t.device.type == "cuda" for t in tensors.values()):
        torch.cuda.synchronize()
    check_fence(before, tensors, rank)
    return out
