"""Fault injection inside the workers of a weightsync-backend vLLM engine: a rank armed to die.

A worker extension (`worker_extension_cls`, tests/support/vllm_plugin_faults.py); through
`worker_call(engine, "wstest_arm_exit", round)` each worker of that engine (TP 1: its one rank)
exits before that round of its next ws_run (a destination killed mid-transfer, without a word
to its peers): the rank's participant runs its transfer with these hooks (`_ws_hooks`, as the
demo's armable participants do).
"""

from __future__ import annotations

from sync_runtime.testing.faults import exit_before_round
from tests.support.vllm_plugin_faults import PluginRankAccess


class ExitFaultExtension(PluginRankAccess):
    def wstest_arm_exit(self, round_index: int) -> None:
        self._wstest_rank()._ws_hooks = exit_before_round(round_index, 17)
