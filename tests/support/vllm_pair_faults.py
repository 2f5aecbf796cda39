"""The worker extension of the shared Qwen3 TP 1 pair (tests/engines/conftest.py `qwen3_pair`):
both fault sets of the modules that share it, each off until a test calls it.

- test_vllm_dense: `ws_arm_exit` (tests/support/vllm_faults.py: a rank dies mid-transfer);
- test_vllm_delta: `ws_alter_base`, `ws_forget_base`, `ws_base_checksums`
  (tests/support/vllm_delta_faults.py: the kept delta base).

An engine serves and syncs as the plain extension does until one of them is called.
"""

from __future__ import annotations

from sync_runtime.engines.vllm_worker import VllmWorkerExtension
from tests.support.vllm_delta_faults import BaseFaultParticipant
from tests.support.vllm_faults import ArmableParticipant

EXTENSION = "tests.support.vllm_pair_faults.PairFaultExtension"


class PairFaultParticipant(ArmableParticipant, BaseFaultParticipant):
    """A vLLM rank with both modules' hooks (the two sets share no method)."""


class PairFaultExtension(VllmWorkerExtension):
    participant_class = PairFaultParticipant
