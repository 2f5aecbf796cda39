"""Fault injection inside vLLM workers: a worker extension whose rank can be armed to die.

`worker_extension_cls=EXTENSION`; `actor.ws_rank_call.remote(i, "ws_arm_exit", (round,))`
makes local rank i's process exit before that round of its next ws_run (a destination killed
mid-transfer, without a word to its peers).
"""

from __future__ import annotations

from sync_runtime.engines.vllm_worker import VllmRankParticipant, VllmWorkerExtension
from sync_runtime.testing.faults import exit_before_round

EXTENSION = "tests.support.vllm_faults.ArmableWorkerExtension"


class ArmableParticipant(VllmRankParticipant):
    def ws_arm_exit(self, round_index: int) -> None:
        self._ws_hooks = exit_before_round(round_index, 17)


class ArmableWorkerExtension(VllmWorkerExtension):
    participant_class = ArmableParticipant
