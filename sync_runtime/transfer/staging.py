"""Destination staging: where a sync's bytes wait for the collective decision (design §2.5).

Three policies, chosen per WeightSync (`spec.transport.staging`):
- `host` (default): staging lives in host memory (pinned when the live tensors are on CUDA) and
  is copied onto the device only at commit, after the decision. Extra device memory: the
  engine's in-flight bucket buffers only (bounded by the planner's staging budget).
- `device`: a shadow copy next to the live tensors on their device. The commit is one
  device-to-device copy per tensor (fastest), at the cost of 2x the weights' device memory.
- `inplace`: no staging; buckets land in the live tensors as they arrive. The engine must be
  paused for the whole sync, and a sync that fails after the first byte leaves the replica
  `poisoned` (neither version) until a later sync resends it in full.

`Staging` is the small Protocol the engine and the participant need; an engine integration
(e.g. one that applies the staged shard through its own weight loaders at commit) implements
it instead of `DestinationWeights`.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from types import MappingProxyType
from typing import Literal, Protocol, get_args, runtime_checkable

import torch

from sync_runtime.core.layouts.base import Box, box_numel
from sync_runtime.errors import StagingError
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest

StagingPolicy = Literal["host", "device", "inplace"]
POLICIES: tuple[str, ...] = get_args(StagingPolicy)


@runtime_checkable
class Staging(Protocol):
    """What the transfer engine and a participant need from a destination rank."""

    version: str
    """The committed version ("" when none yet)."""
    poisoned: bool
    """Live memory holds neither the committed version nor a new one (a failed in-place sync)."""

    @property
    def tensors(self) -> MappingProxyType[str, torch.Tensor]: ...

    @property
    def staging_active(self) -> bool: ...

    @property
    def pending_version(self) -> str | None: ...

    def checksums(self) -> dict[str, str]: ...

    def set_policy(self, policy: StagingPolicy) -> None:
        """Called before each sync's `begin` with spec.transport.staging; an implementation that
        supports only some policies raises StagingError for the others."""
        ...

    def begin(self, version: str) -> None: ...

    def staged(self, name: str, *, fully_written: bool = False) -> torch.Tensor: ...

    def staged_checksum(self) -> str: ...

    def commit(self, version: str | None = None) -> str: ...

    def abort(self) -> None: ...


class MemoryMeter:
    """Bytes of staging a destination holds per tier, with the peak of each since `reset()`.

    What it measures is the staging layer's own allocations, attributed to the memory they were
    allocated in: "device" = next to the live tensors, "host" = host staging. On CUDA these are
    physically different memories (torch.cuda.memory_allocated agrees with the device figure,
    see tests/test_staging.py). On a CPU-only machine both tiers are the same RAM: the meter then
    shows where the policy put each buffer, not a physical saving. Engine bucket buffers are
    outside it (they are bounded by the planner's staging budget for every policy).
    """

    def __init__(self) -> None:
        self.current = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self._lock = threading.Lock()

    def add(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.current[tier] += nbytes
            self.peak[tier] = max(self.peak[tier], self.current[tier])

    def reset(self) -> None:
        with self._lock:
            self.peak = dict(self.current)


class StagingProgress:
    """What every `Staging` tracks between `begin` and `commit`/`abort`: the staged buffers (None
    when no sync is staged) and the version they are for."""

    _staged: dict[str, torch.Tensor] | None = None
    _pending_version: str | None = None

    @property
    def staging_active(self) -> bool:
        return self._staged is not None

    @property
    def pending_version(self) -> str | None:
        return self._pending_version


class DestinationWeights(StagingProgress):
    """What a destination participant holds: live tensors served by the engine, plus staging.

    Protocol per sync: `begin(version)` -> the engine writes staged tensors -> `commit()` when
    every rank succeeded, `abort()` otherwise. With `host` and `device` staging, live tensors
    are only written by `commit()`, and in place (`copy_`), so the inference engine's
    references to them stay valid; with `inplace` the engine writes them directly.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        version: str = "",
        *,
        keep_staging: bool = False,
        policy: StagingPolicy = "host",
    ) -> None:
        """`keep_staging=True` keeps staging allocated after a commit for the next sync: twice the
        weights' memory for good, but on CPU a fresh multi-MB buffer costs a page fault per 4 KiB
        on first write (about as much as the transfer itself); CUDA's caching allocator already
        keeps freed blocks, so there it makes little difference."""
        self._live = dict(tensors)
        self.version = version
        self.keep_staging = keep_staging
        self.policy: StagingPolicy = check_policy(policy)
        self.poisoned = False
        self.meter = MemoryMeter()
        self._spare: dict[str, torch.Tensor] = {}
        """Staging buffers of the last committed sync, reused by the next (keep_staging only)."""
        self._staged: dict[str, torch.Tensor] | None = None
        self._pending_version: str | None = None
        self._lock = threading.Lock()

    @property
    def tensors(self) -> MappingProxyType[str, torch.Tensor]:
        """The live tensors (read-only mapping; do not write into them outside commit)."""
        return MappingProxyType(self._live)

    def checksums(self) -> dict[str, str]:
        """Per live tensor, a stable hex digest of its bytes (the same checksum the engine verifies)."""
        with self._lock:  # never read live tensors half way through a commit's copies
            return {name: hex_digest(checksum_tensor(t)) for name, t in sorted(self._live.items())}

    def set_policy(self, policy: StagingPolicy) -> None:
        """Switch policy between syncs (the spec changed); refused while a sync is staged."""
        with self._lock:
            if check_policy(policy) == self.policy:
                return  # nothing to switch; begin() then drops any staging an interrupted sync left
            if self._staged is not None:
                raise StagingError(f"cannot switch staging to {policy!r} in the middle of a sync")
            if check_policy(policy) != self.policy:
                self._free_spare()
            self.policy = policy

    def begin(self, version: str) -> None:
        """Start staging `version`; drops any previous staging (idempotent reset).

        `inplace`: from here on live memory is being overwritten, so the replica counts as
        poisoned until `commit()` (a crash in between must not look like the old version).
        """
        with self._lock:
            self._staged = {}
            self._pending_version = version
            self.meter.reset()
            if self.policy == "inplace":
                self.poisoned = True

    def staged(self, name: str, *, fully_written: bool = False) -> torch.Tensor:
        """The staging copy of live tensor `name` (the live tensor itself for `inplace`).

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
                    raise StagingError(f"no live tensor named {name!r} to stage", tensor=name)
                buf = self._new_staging(name, live, fully_written)
                self._staged[name] = buf
            return buf

    def _new_staging(self, name: str, live: torch.Tensor, fully_written: bool) -> torch.Tensor:
        if self.policy == "inplace":
            if not fully_written:
                live.zero_()  # padding: the old version must not survive in rows no one writes
            return live
        buf = self._spare.pop(name, None)
        if buf is None:
            pinned = self.policy == "host" and live.device.type == "cuda"
            device = live.device if self.policy == "device" else torch.device("cpu")
            buf = _new_buffer(live, device, zeroed=not fully_written, pinned=pinned)
            self.meter.add(_tier(self.policy), _nbytes(buf))
        elif not fully_written:
            buf.zero_()
        return buf

    def staged_checksum(self) -> str:
        """One digest over every staged tensor's checksum: what a rank records as `prepared` and
        checks again right before it applies (so bytes changed after the decision are caught)."""
        with self._lock:
            if self._staged is None:
                raise StagingError("staged_checksum() without begin(version)")
            return combine_checksums(self._staged)

    def commit(self, version: str | None = None) -> str:
        """Copy staging into the live tensors in place, set the version, free staging.

        `version`, when given, must be the one staging was begun for: committing another
        version's bytes under this name would mislabel the replica.
        """
        with self._lock:
            if self._staged is None or self._pending_version is None:
                raise StagingError("commit() without begin(version)")
            if version is not None and version != self._pending_version:
                raise StagingError(f"commit({version!r}) but staging holds version {self._pending_version!r}")
            if self.policy != "inplace":
                for name, buf in self._staged.items():
                    self._live[name].copy_(buf, non_blocking=buf.is_pinned())
                if any(t.device.type == "cuda" for t in self._live.values()):
                    torch.cuda.synchronize()  # pinned copies are asynchronous: done before "committed"
            if self.keep_staging and self.policy != "inplace":
                self._spare = self._staged
            else:
                self._drop(self._staged)
            self.version = self._pending_version
            self.poisoned = False
            self._staged = None
            self._pending_version = None
            return self.version

    def abort(self) -> None:
        """Drop staging; with host/device staging, live tensors and version are untouched.
        With `inplace` the live tensors may hold part of the new version: `poisoned` stays set."""
        with self._lock:
            # Never reused: a timed-out receive of the failed sync may still write into them.
            if self._staged is not None:
                self._drop(self._staged)
            self._free_spare()
            self._staged = None
            self._pending_version = None

    def _drop(self, staged: dict[str, torch.Tensor]) -> None:
        if self.policy != "inplace":
            for buf in staged.values():
                self.meter.add(_tier(self.policy), -_nbytes(buf))

    def _free_spare(self) -> None:
        self._drop(self._spare)
        self._spare = {}


def check_policy(policy: str) -> StagingPolicy:
    if policy not in POLICIES:
        raise StagingError(f"staging policy {policy!r}: must be one of {', '.join(POLICIES)}")
    return policy  # type: ignore[return-value]


def combine_checksums(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of (name, checksum) over `tensors` in name order."""
    return combine_hex({name: hex_digest(checksum_tensor(t)) for name, t in tensors.items()})


def combine_hex(sums: dict[str, str]) -> str:
    """`combine_checksums` of tensors whose hex checksums (`hex_digest`) are already known."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for name in sorted(sums):
        h.update(name.encode() + b"\0" + sums[name].encode())
    return h.hexdigest()


def _tier(policy: str) -> str:
    return "device" if policy == "device" else "host"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_HUGE_PAGE = 2 << 20


def _new_buffer(like: torch.Tensor, device: torch.device, *, zeroed: bool, pinned: bool) -> torch.Tensor:
    """A contiguous tensor shaped like `like` on `device`; all zeros when `zeroed`.

    Large host buffers are anonymous mappings advised to use transparent huge pages: the kernel
    hands them out zeroed (so no zero pass even for padded tensors) and faults them in 2 MiB at
    a time. With malloc'd 4 KiB pages the first write into fresh staging cost ~0.5 ms per MB,
    about as much as moving the bytes (195 MB: 111 ms fresh vs 24 ms warm; 29 ms huge pages).
    Pinned host buffers (for CUDA live tensors) come from torch's pinned allocator instead.
    """
    nbytes = like.numel() * like.element_size()
    if device.type != "cpu" or pinned or nbytes < 2 * _HUGE_PAGE:
        make = torch.zeros if zeroed else torch.empty
        return make(like.shape, dtype=like.dtype, device=device, pin_memory=pinned)
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
