"""Destination staging: receive into shadow copies, commit in place only after a good sync."""

from __future__ import annotations

import threading
from types import MappingProxyType

import torch

from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from sync_runtime.transfer.config import StagingError


class DestinationWeights:
    """What a destination participant holds: live tensors served by the engine, plus staging.

    Protocol per sync: `begin(version)` -> the engine writes staged tensors -> `commit()` when
    every rank succeeded, `abort()` otherwise. Live tensors are only written by `commit()`, and
    in place (`copy_`), so the inference engine's references to them stay valid.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], version: str = "") -> None:
        self._live = dict(tensors)
        self.version = version
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

    def staged(self, name: str) -> torch.Tensor:
        """The staging copy of live tensor `name`, allocated zeroed on first use.

        Zero, not a copy of the live tensor: regions no transfer writes are padding (vocab rows
        past V), and the previous version must not leak into the new one.
        """
        with self._lock:
            if self._staged is None:
                raise StagingError("begin(version) was not called before receiving into staging")
            buf = self._staged.get(name)
            if buf is None:
                live = self._live.get(name)
                if live is None:
                    raise StagingError(f"no live tensor named {name!r} to stage")
                buf = torch.zeros_like(live, memory_format=torch.contiguous_format)
                self._staged[name] = buf
            return buf

    def commit(self) -> str:
        """Copy staging into the live tensors in place, set the version, free staging."""
        with self._lock:
            if self._staged is None or self._pending_version is None:
                raise StagingError("commit() without begin(version)")
            for name, buf in self._staged.items():
                self._live[name].copy_(buf)
            self.version = self._pending_version
            self._staged = None
            self._pending_version = None
            return self.version

    def abort(self) -> None:
        """Drop staging; live tensors and version are untouched."""
        with self._lock:
            self._staged = None
            self._pending_version = None
