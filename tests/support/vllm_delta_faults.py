"""Faults of a vLLM rank's kept delta base (engines/vllm_delta.py), inside the workers of a
weightsync-backend engine.

A worker extension (`worker_extension_cls`, tests/support/vllm_plugin_faults.py); through
`worker_call(engine, method)`, on each worker of that engine (TP 1: its one rank):
- `wstest_alter_base`: flips one bit of the largest tensor of the kept copy: the base no longer
  holds the bytes of the version it is recorded for (live weights untouched); its name;
- `wstest_forget_base`: drops the copy, as an engine restart leaves the rank (no base);
- `wstest_base_checksums`: the kept copy's per-tensor checksums (they must be the committed bytes').
"""

from __future__ import annotations

import torch

from sync_runtime.engines.vllm_worker import VllmStaging
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from tests.support.vllm_plugin_faults import PluginRankAccess


class BaseFaultExtension(PluginRankAccess):
    def _wstest_staging(self) -> VllmStaging:
        staging = self._wstest_rank()._ws_state().destination
        assert isinstance(staging, VllmStaging)
        return staging

    def wstest_alter_base(self) -> str:
        base = self._wstest_staging().delta_base
        name = max(base, key=lambda n: base[n].numel())
        base[name].view(torch.int16).reshape(-1)[11] ^= 1
        return name

    def wstest_forget_base(self) -> None:
        self._wstest_staging()._base.drop()  # what a restarted engine holds: no copy of any version

    def wstest_base_checksums(self) -> dict[str, str]:
        return {
            n: hex_digest(checksum_tensor(t)) for n, t in sorted(self._wstest_staging().delta_base.items())
        }
