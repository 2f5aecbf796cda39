"""A vLLM engine as a user runs it in Ray: an actor holding `vllm.LLM` (tests/engines/test_vllm_plugin.py)
or `AsyncLLM` (tests/engines/test_vllm_async_actor.py) with the weightsync weight-transfer backend
enabled, and nothing else from WeightSync but, for `AsyncLLM`, the one adapter method.
The `vllm.LLM` actor and the engine settings are sync_runtime/testing/vllm_user_engines.py's (the
`--engine vllm` demo runs the same actor); re-exported here for the tests.
Runs only under the engine environment (tools/vllm_env.sh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from sync_runtime.testing.vllm_user_engines import UserEngine, engine_args, greedy, row_of

__all__ = ["AsyncUserEngine", "UserEngine", "engine_args", "greedy", "row_of", "user_deployment"]


class AsyncUserEngine:
    """What a user writes for rollouts (verl, SkyRL, NeMo-RL style): an async Ray actor holding an
    `AsyncLLM`, serving concurrent `generate` calls; from WeightSync only the adapter method."""

    def __init__(self, model: str, tp: int) -> None:
        self.model, self.tp = model, tp

    async def start(self) -> str:
        """Build the engine on the actor's event loop (AsyncLLM binds its output handler to it)."""
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        # at TP 1 the worker runs in the engine core's process (vLLM's default executor for one
        # worker, "uni"): one process fewer to start; AsyncLLM keeps its engine core apart
        uni = {"distributed_executor_backend": "uni"} if self.tp == 1 else {}
        args = AsyncEngineArgs(**(engine_args(self.model, self.tp) | uni))
        self.engine = AsyncLLMEngine.from_engine_args(args)
        return str(await self.engine.get_weight_version())

    async def weightsync(self, op: str, *args: object) -> object:  # WeightSync: the one adapter
        from sync_runtime.engines.vllm_actor import weightsync_control

        return await weightsync_control(self.engine, op, *args)

    async def _one(self, row: list[int], max_tokens: int) -> tuple[dict, list[tuple[str, int, int]]]:
        import uuid

        params = greedy(max_tokens)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": row}, params, uuid.uuid4().hex):
            final = out
        assert final is not None
        c = final.outputs[0]
        row_out = row_of(c)
        return row_out, [(s.version, s.start, s.end) for s in c.weight_versions or []]

    async def generate(self, rows: list[list[int]], max_tokens: int, *, one_at_a_time: bool) -> list[dict]:
        """The rows one after another (repeatable bits: no row shares an engine step)."""
        del one_at_a_time  # always one at a time here
        return [(await self._one(r, max_tokens))[0] for r in rows]

    async def generate_versioned(self, row: list[int], max_tokens: int) -> tuple[dict, list]:
        """One request as a client sends it, with vLLM's weight-version spans of its tokens."""
        return await self._one(row, max_tokens)

    async def weight_version(self) -> str:
        return str(await self.engine.get_weight_version())

    def shutdown(self) -> None:
        self.engine.shutdown()


@contextlib.contextmanager
def user_deployment(
    actor_class: type, directory: Path, *, namespace: str, prefix: str, tp: int, spawn: bool = False
) -> Iterator[dict]:
    """The demo's Megatron-layout sources (tp=2) holding Qwen3 at v1, its checkpoint-loaded oracle
    (reference cache), the user's actor `actor_class` (dummy weights) started, and WeightSync's
    ranks actor attached to it as replica 0 of destination `{prefix}-r`; all stopped afterwards.
    `spawn`: the engine spawns all its children, as vLLM's CPU platform does outside the test
    session (else its own core process forks the workers)."""
    import ray

    from sync_runtime.core.topology import ParallelSpec
    from sync_runtime.engines.vllm_actor import ActorControl
    from sync_runtime.engines.vllm_ranks import attach
    from sync_runtime.testing.vllm_deploy import stop_replicas
    from tests.support.session_site.sitecustomize import KEEP_SPAWN_ENV
    from tests.support.vllm_deploy import deploy, destination_ref, engine_env, sync_spec

    dst = ParallelSpec.parse(f"tp={tp}")
    env = engine_env(tp) | ({KEEP_SPAWN_ENV: "1"} if spawn else {})
    references = {"ref": (f"ref-{prefix}", {"tp": tp})}
    with deploy(
        "qwen3", directory, src="tp=2", dst=dst, namespace=namespace, engines={}, references=references
    ) as d:
        user = (
            ray.remote(actor_class)
            .options(num_cpus=0, runtime_env={"env_vars": env})
            .remote(d.setup.model.rsplit("/", 1)[0], tp)
        )
        ranks = None
        try:
            initial = ray.get(user.start.remote(), timeout=900)  # the engine is up
            ranks = attach(f"{prefix}-r0", namespace, ActorControl(user), ranks=tp)
            ray.get(ranks.ws_num_ranks.remote(), timeout=300)
            destinations = [destination_ref("inf", namespace, f"{prefix}-r", dst)]
            yield {
                "setup": d.setup,
                "user": user,
                "ranks": ranks,
                "ref": d.reference_calls[0]["ref"],
                "spec": sync_spec(d.setup.model, namespace, d.setup.src, destinations, "v1"),
                "manifest": d.manifest,
                "dst": dst,
                "initial": initial,
            }
        finally:
            stop_replicas([user])
            if ranks is not None:
                ray.kill(ranks)
