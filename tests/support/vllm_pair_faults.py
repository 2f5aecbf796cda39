"""The test worker extension of the shared Qwen3 TP 1 pair (tests/engines/conftest.py
`qwen3_pair`: two `UserEngine`s with the weightsync backend): both fault sets of the modules that
share it, each off until a test calls it with `worker_call` (tests/support/vllm_plugin_faults.py).

- test_vllm_dense: `wstest_arm_exit` (tests/support/vllm_faults.py: a rank dies mid-transfer);
- test_vllm_delta: `wstest_alter_base`, `wstest_forget_base`, `wstest_base_checksums`
  (tests/support/vllm_delta_faults.py: the kept delta base).

The extension only adds methods to vLLM's worker: an engine serves and syncs through the plugin
exactly as without it until one of them is called.
"""

from __future__ import annotations

from tests.support.vllm_delta_faults import BaseFaultExtension
from tests.support.vllm_faults import ExitFaultExtension
from tests.support.vllm_plugin_faults import worker_call

__all__ = ["EXTENSION", "PairFaultExtension", "worker_call"]

EXTENSION = "tests.support.vllm_pair_faults.PairFaultExtension"


class PairFaultExtension(ExitFaultExtension, BaseFaultExtension):
    """Both modules' hooks (the two sets share no method)."""
