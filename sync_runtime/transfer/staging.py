"""Destination staging: receive into shadow copies, commit in place only after a good sync."""

from __future__ import annotations

import contextlib
import mmap
import threading
from types import MappingProxyType

import torch

from sync_runtime.core.layouts.base import Box, box_numel
from sync_runtime.errors import StagingError
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest


class DestinationWeights:
    """What a destination participant holds: live tensors served by the engine, plus staging.

    Protocol per sync: `begin(version)` -> the engine writes staged tensors -> `commit()` when
    every rank succeeded, `abort()` otherwise. Live tensors are only written by `commit()`, and
    in place (`copy_`), so the inference engine's references to them stay valid.
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor], version: str = "", *, keep_staging: bool = False
    ) -> None:
        """`keep_staging=True` keeps staging allocated after a commit for the next sync: twice the
        weights' memory for good, but on CPU a fresh multi-MB buffer costs a page fault per 4 KiB
        on first write (about as much as the transfer itself); CUDA's caching allocator already
        keeps freed blocks, so there it makes little difference."""
        self._live = dict(tensors)
        self.version = version
        self.keep_staging = keep_staging
        self._spare: dict[str, torch.Tensor] = {}
        """Staging buffers of the last committed sync, reused by the next (keep_staging only)."""
        self._staged: dict[str, torch.Tensor] | None = None
        self._pending_version: str | None = None
        self._lock = threading.Lock()

    @property
    def tensors(self) -> MappingProxyType[str, torch.Tensor]:
        """The live tensors (read-only mapping; do not write into them outside commit)."""
        return MappingProxyType(self._live)

    @property
    def staging_active(self) -> bool:
        return self._staged is not None

    def checksums(self) -> dict[str, str]:
        """Per live tensor, a stable hex digest of its bytes (the same checksum the engine verifies)."""
        return {name: hex_digest(checksum_tensor(t)) for name, t in sorted(self._live.items())}

    def begin(self, version: str) -> None:
        """Start staging `version`; drops any previous staging (idempotent reset)."""
        with self._lock:
            self._staged = {}
            self._pending_version = version

    def staged(self, name: str, *, fully_written: bool = False) -> torch.Tensor:
        """The staging copy of live tensor `name`, allocated on first use.

        Zeroed, not a copy of the live tensor: regions no transfer writes are padding (vocab rows
        past V), and the previous version must not leak into the new one. `fully_written=True`
        (on the first call) skips the zeroing: the caller guarantees every element is written
        before commit (the engine checks that the plan's boxes tile the tensor exactly).
        """
        with self._lock:
            if self._staged is None:
                raise StagingError("begin(version) was not called before receiving into staging")
            buf = self._staged.get(name)
            if buf is None:
                live = self._live.get(name)
                if live is None:
                    raise StagingError(f"no live tensor named {name!r} to stage")
                buf = self._spare.pop(name, None)
                if buf is None:
                    buf = _new_buffer(live, zeroed=not fully_written)
                elif not fully_written:
                    buf.zero_()
                self._staged[name] = buf
            return buf

    def commit(self) -> str:
        """Copy staging into the live tensors in place, set the version, free staging."""
        with self._lock:
            if self._staged is None or self._pending_version is None:
                raise StagingError("commit() without begin(version)")
            for name, buf in self._staged.items():
                self._live[name].copy_(buf)
            if self.keep_staging:
                self._spare = self._staged
            self.version = self._pending_version
            self._staged = None
            self._pending_version = None
            return self.version

    def abort(self) -> None:
        """Drop staging; live tensors and version are untouched."""
        with self._lock:
            # Never reused: a timed-out receive of the failed sync may still write into them.
            self._spare = {}
            self._staged = None
            self._pending_version = None


_HUGE_PAGE = 2 << 20


def _new_buffer(like: torch.Tensor, *, zeroed: bool) -> torch.Tensor:
    """A contiguous tensor shaped like `like`; all zeros when `zeroed`.

    Large host buffers are anonymous mappings advised to use transparent huge pages: the kernel
    hands them out zeroed (so no zero pass even for padded tensors) and faults them in 2 MiB at
    a time. With malloc'd 4 KiB pages the first write into fresh staging cost ~0.5 ms per MB,
    about as much as moving the bytes (195 MB: 111 ms fresh vs 24 ms warm; 29 ms huge pages).
    """
    nbytes = like.numel() * like.element_size()
    if like.device.type != "cpu" or nbytes < 2 * _HUGE_PAGE:
        make = torch.zeros_like if zeroed else torch.empty_like
        return make(like, memory_format=torch.contiguous_format)
    # Private: a shared anonymous mapping is shmem, which THP leaves alone on most systems.
    area = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages, still zeroed by the kernel
        with contextlib.suppress(OSError):
            area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` alive as long as any view
    start = -raw.data_ptr() % _HUGE_PAGE  # huge pages need 2 MiB aligned addresses
    return raw[start : start + nbytes].view(like.dtype).view(like.shape)


def tiles_exactly(boxes: list[Box], shape: tuple[int, ...]) -> bool:
    """True when `boxes` cover every element of `shape` exactly once (no gap, no overlap).

    Disjoint boxes whose sizes add up to the tensor's cover it. Sorting by the first dim's
    start bounds the pairwise overlap test to boxes that share first-dim rows (few, in plans).
    """
    if not shape:
        return len(boxes) == 1  # a 0-dim tensor: its one element, written once
    total = 1
    for size in shape:
        total *= size
    if sum(box_numel(b) for b in boxes) != total:
        return False
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b[0][0] >= a[0][1]:
                break
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True)):
                return False
    return True
