"""Test hooks inside the workers of a vLLM engine started with the weightsync backend, injected
from the test side only (WeightSync's product code carries none).

vLLM's public `worker_extension_cls` engine argument mixes a test class into every worker
(tests pass it in a `UserEngine`'s `extra` engine arguments); the test calls its methods with
vLLM's `collective_rpc`, run inside the user's actor through Ray's `__ray_call__` as
`ActorControl` reaches the engine (`worker_call`).

Where the hooks reach: in vLLM 0.32 a worker holds its weight-transfer engine as
`Worker.weight_transfer_engine` (v1/worker/gpu_worker.py: built in `load_model` from
`weight_transfer_config`; the CPU worker inherits it). With the weightsync backend that is
`vllm_plugin.backend.WeightSyncEngine`, whose `_dispatch` (`_Dispatch`, the worker extension's
dispatch) holds the worker's destination rank (`_ws_part`, a `VllmRankParticipant`, set up at
`init_weight_transfer_engine`), and through it the rank's `VllmStaging`: the objects a
`VllmReplica`'s test participant subclass used to be.
"""

from __future__ import annotations

from typing import Any

WORKER_CALL_TIMEOUT_S = 300.0


class PluginRankAccess:
    """Base of the test worker extensions: this worker's weightsync destination rank."""

    def _wstest_rank(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        part = getattr(getattr(engine, "_dispatch", None), "_ws_part", None)
        if part is None:
            raise RuntimeError(
                f"this worker's weight-transfer engine ({type(engine).__name__}) holds no weightsync "
                "rank: the engine was not started with the weightsync backend, or not attached yet"
            )
        return part


def worker_call(engine: Any, method: str, *args: Any, timeout_s: float = WORKER_CALL_TIMEOUT_S) -> list[Any]:
    """`method(*args)` of the engine's test worker extension on every worker of `engine` (a
    `UserEngine` actor, which holds its `vllm.LLM` as `llm`), through `collective_rpc` inside the
    actor; each worker's answer, in vLLM's worker order (TP 1: one)."""
    import ray

    return list(ray.get(engine.__ray_call__.remote(_collective_rpc, method, args), timeout=timeout_s))


def _collective_rpc(instance: Any, method: str, args: tuple) -> list[Any]:
    """Runs inside the user's actor (`__ray_call__`)."""
    return list(instance.llm.collective_rpc(method, args=args))
