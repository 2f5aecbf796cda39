"""Faults of a vLLM rank's kept delta base (engines/vllm_delta.py), inside the vLLM workers.

`worker_extension_cls=EXTENSION`; through `actor.ws_rank_call.remote(i, method, ())`:
- `ws_alter_base`: flips one bit of the largest tensor of the kept copy: the base no longer holds
  the bytes of the version it is recorded for (live weights untouched);
- `ws_forget_base`: drops the copy, as an engine restart leaves the rank (no base);
- `ws_base_checksums`: the kept copy's per-tensor checksums (they must be the committed bytes').
"""

from __future__ import annotations

import torch

from sync_runtime.engines.vllm_worker import VllmRankParticipant, VllmStaging, VllmWorkerExtension
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest

EXTENSION = "tests.support.vllm_delta_faults.BaseFaultExtension"


class BaseFaultParticipant(VllmRankParticipant):
    def _staging(self) -> VllmStaging:
        staging = self._ws_state().destination
        assert isinstance(staging, VllmStaging)
        return staging

    def ws_alter_base(self) -> str:
        base = self._staging().delta_base
        name = max(base, key=lambda n: base[n].numel())
        base[name].view(torch.int16).reshape(-1)[11] ^= 1
        return name

    def ws_forget_base(self) -> None:
        self._staging()._base.drop()  # what a restarted engine holds: no copy of any version

    def ws_base_checksums(self) -> dict[str, str]:
        return {n: hex_digest(checksum_tensor(t)) for n, t in sorted(self._staging().delta_base.items())}


class BaseFaultExtension(VllmWorkerExtension):
    participant_class = BaseFaultParticipant
