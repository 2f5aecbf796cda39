"""A vLLM engine inside a Ray actor the user wrote: `vllm.LLM` by convention, `AsyncLLM` through
one small adapter method.

`ActorControl` is the `EngineControl` (engines/vllm_ranks.py) of such an engine. It first asks
the actor, through Ray's `__ray_call__`, which engine it holds (`find_engine`: the actor's one
attribute holding a `vllm.LLM` or `vllm.AsyncLLMEngine`, or the attribute named by `attr`).

- **`vllm.LLM`** (synchronous): nothing to add to the actor. Every control operation runs as a
  closure through `__ray_call__` (`_llm_call`). Pause and resume are no-ops: a single-threaded
  actor runs one call at a time, and the apply is one call, never concurrent with a `generate`.
- **`AsyncLLM`** (what RL frameworks run for rollouts, in async actors): its methods are
  coroutines bound to the actor's event loop, and Ray runs a `__ray_call__` closure on another
  thread and does not await what it returns, so the actor exposes one async method that awaits
  WeightSync's call on the loop:

      from sync_runtime.engines.vllm_actor import weightsync_control

      class Rollout:                      # your async Ray actor
          ...
          async def weightsync(self, op, *args):
              return await weightsync_control(self.engine, op, *args)

  Pause and resume are real there (`pause_generation(mode=...)` / `resume_generation()`): the
  actor keeps serving `generate` calls while the shards stream into host staging, and pauses
  only around the apply, with the destination's pause mode.
"""

from __future__ import annotations

import contextlib
from typing import Any

from sync_runtime.engines.vllm_ranks import ANSWER_TIMEOUT_S, one_update_session
from sync_runtime.errors import DestinationError

PROBE_S = 5.0
"""How long `ActorControl.alive` waits for the actor's answer before taking it as busy."""
ADAPTER = "weightsync"
"""The async method an actor holding an `AsyncLLM` exposes (see module doc)."""


def _engine_classes() -> tuple[type, type]:
    from vllm import LLM, AsyncLLMEngine  # AsyncLLMEngine is vLLM V1's AsyncLLM

    return LLM, AsyncLLMEngine


def find_engine(instance: Any, attr: str | None) -> Any:
    """The `vllm.LLM` or `AsyncLLM` a user's actor holds: `attr`, or its only attribute that is one."""
    kinds = _engine_classes()
    if attr is not None:
        engine = getattr(instance, attr, None)
        if not isinstance(engine, kinds):
            raise DestinationError(f"{type(instance).__name__}.{attr} is not a vllm.LLM or AsyncLLM")
        return engine
    found = [k for k, v in vars(instance).items() if isinstance(v, kinds)]
    if len(found) != 1:
        raise DestinationError(
            f"{type(instance).__name__} holds {len(found)} vLLM engine attributes ({found}): name one"
        )
    return getattr(instance, found[0])


def _probe(instance: Any, attr: str | None) -> str:
    """Runs inside the user's actor: "llm", or "async" when the actor has the adapter method."""
    engine = find_engine(instance, attr)
    if isinstance(engine, _engine_classes()[0]):
        return "llm"
    if not callable(getattr(instance, ADAPTER, None)):
        raise DestinationError(
            f"{type(instance).__name__} holds an AsyncLLM: add `async def {ADAPTER}(self, op, *args): "
            f"return await weightsync_control(self.<engine>, op, *args)` "
            "(sync_runtime.engines.vllm_actor; docs/vllm.md)"
        )
    return "async"


def _llm_call(instance: Any, attr: str | None, op: str, args: tuple) -> Any:
    """Runs inside the user's actor (`__ray_call__`): one control operation on its `vllm.LLM`."""
    llm = find_engine(instance, attr)
    if op == "world_size":
        return int(llm.llm_engine.vllm_config.parallel_config.world_size)
    if op == "init":
        return llm.init_weight_transfer_engine({"init_info": args[0]})
    if op == "start":
        return llm.start_weight_update()
    if op == "start_draft":
        return llm.start_draft_weight_update()
    if op == "update":
        return llm.update_weights({"update_info": args[0]})
    if op == "finish":
        return llm.finish_weight_update(weight_version=args[0])
    if op == "one_update":
        return one_update_session(
            lambda: llm.start_weight_update(),
            lambda info: llm.update_weights({"update_info": info}),
            lambda version: llm.finish_weight_update(weight_version=version),
            args[0],
        )
    if op == "version":
        return str(llm.get_weight_version())
    if op == "alive":
        from sync_runtime.engines.vllm_apply import llm_engine_failed

        return not llm_engine_failed(llm)
    raise DestinationError(f"unknown engine operation {op!r}")


async def weightsync_control(engine: Any, op: str, *args: Any) -> Any:
    """One WeightSync control operation on an `AsyncLLM`, awaited on the actor's event loop
    (call it from the actor's `weightsync` method: see module doc). vLLM's public RL API only."""
    if op == "world_size":
        return int(engine.vllm_config.parallel_config.world_size)
    if op == "init":
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        return await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=args[0]))
    if op == "start":
        return await engine.start_weight_update()
    if op == "start_draft":
        return await engine.start_draft_weight_update()
    if op == "update":
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        return await engine.update_weights(WeightTransferUpdateRequest(update_info=args[0]))
    if op == "finish":
        return await engine.finish_weight_update(weight_version=args[0])
    if op == "one_update":
        return await _one_update_session(engine, args[0])
    if op == "pause":
        # vLLM's default clear_cache=True, as the server's /pause route: cached KV and prefixes
        # were computed with the old weights.
        return await engine.pause_generation(mode=args[0])
    if op == "resume":
        return await engine.resume_generation()
    if op == "version":
        return str(await engine.get_weight_version())
    if op == "alive":
        return not engine.errored
    raise DestinationError(f"unknown engine operation {op!r}")


class ActorControl:
    """EngineControl of a `vllm.LLM` or `AsyncLLM` inside a user's Ray actor (see module doc)."""

    def __init__(self, actor: Any, attr: str | None = None, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self.actor, self.attr, self.timeout_s = actor, attr, timeout_s
        self._kind: str | None = None

    @property
    def kind(self) -> str:
        """ "llm" or "async", asked of the actor once."""
        if self._kind is None:
            self._kind = str(self._get(self.actor.__ray_call__.remote(_probe, self.attr)))
        return self._kind

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def _ref(self, op: str, *args: Any) -> Any:
        if self.kind == "async":
            return getattr(self.actor, ADAPTER).remote(op, *args)
        return self.actor.__ray_call__.remote(_llm_call, self.attr, op, args)

    def _call(self, op: str, *args: Any) -> Any:
        return self._get(self._ref(op, *args))

    def world_size(self) -> int:
        return int(self._call("world_size"))

    def init(self, init_info: dict[str, Any]) -> None:
        self._call("init", init_info)

    def start(self) -> None:
        self._call("start")

    def start_draft(self) -> None:
        self._call("start_draft")

    def update(self, update_info: dict[str, Any]) -> None:
        self._call("update", update_info)

    def finish(self, version: str | None) -> None:
        self._call("finish", version)

    def one_update(self, update_info: dict[str, Any]) -> None:
        """Start, update and finish in one call of the actor: an `LLM`'s actor runs one call at
        a time, so each would otherwise wait behind a `generate` of its own."""
        self._call("one_update", update_info)

    def pause(self, mode: str) -> None:
        if self.kind == "async":  # an LLM: no step runs between the actor's calls
            self._call("pause", mode)

    def resume(self) -> None:
        if self.kind == "async":
            self._call("resume")

    def version(self) -> str:
        return str(self._call("version"))

    def alive(self) -> bool:
        """False once the actor is gone or its engine has failed (a worker died): the proxy then
        fails its wait for a worker's answer at once instead of at the transfer deadline. An
        actor that does not answer within PROBE_S is busy, not dead: an `LLM`'s actor runs one
        call at a time, and a generate call may hold it."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return bool(ray.get(self._ref("alive"), timeout=PROBE_S))
        except GetTimeoutError:
            return True
        except RayActorError:
            return False


async def _one_update_session(engine: Any, update_info: dict[str, Any]) -> None:
    """`vllm_ranks.one_update_session` (its rules: `run_session`) on an `AsyncLLM`, awaited."""
    try:
        await weightsync_control(engine, "start")
    except Exception as e:
        if "already active" not in str(e):
            raise
        await weightsync_control(engine, "finish", None)
        await weightsync_control(engine, "start")
    try:
        await weightsync_control(engine, "update", update_info)
    except Exception:
        with contextlib.suppress(Exception):
            await weightsync_control(engine, "finish", None)
        raise
    await weightsync_control(engine, "finish", None)
