"""ActorControl's engine discovery inside a user's actor (sync_runtime/engines/vllm_actor.py):
which engine the actor holds, and the one-line refusals. vLLM's classes are stood in for by two
local classes; the real engines are driven in tests/engines/test_vllm_plugin.py (`vllm.LLM`) and
tests/engines/test_vllm_async_actor.py (`AsyncLLM`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sync_runtime.engines import vllm_actor
from sync_runtime.errors import DestinationError

pytestmark = pytest.mark.unit


class FakeLLM:
    pass


class FakeAsyncLLM:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def pause_generation(self, *, mode: str) -> None:
        self.calls.append(("pause", mode))

    async def resume_generation(self) -> None:
        self.calls.append(("resume", None))

    async def get_weight_version(self) -> str:
        return "v7"


@pytest.fixture(autouse=True)
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_actor, "_engine_classes", lambda: (FakeLLM, FakeAsyncLLM))


class SyncActor:
    def __init__(self) -> None:
        self.llm = FakeLLM()


class AsyncActor:
    def __init__(self) -> None:
        self.engine = FakeAsyncLLM()

    async def weightsync(self, op: str, *args: Any) -> Any:
        return await vllm_actor.weightsync_control(self.engine, op, *args)


class AsyncActorWithoutAdapter:
    def __init__(self) -> None:
        self.engine = FakeAsyncLLM()


def test_the_engine_kind_is_found_by_convention() -> None:
    assert vllm_actor._probe(SyncActor(), None) == "llm"
    assert vllm_actor._probe(AsyncActor(), None) == "async"
    assert vllm_actor._probe(AsyncActor(), "engine") == "async"


def test_an_async_engine_without_the_adapter_is_refused_in_one_line() -> None:
    with pytest.raises(DestinationError) as e:
        vllm_actor._probe(AsyncActorWithoutAdapter(), None)
    msg = str(e.value)
    assert "\n" not in msg
    assert "AsyncActorWithoutAdapter holds an AsyncLLM: add `async def weightsync(self, op, *args)" in msg


def test_no_engine_two_engines_and_a_wrong_attribute_are_refused() -> None:
    class Empty:
        pass

    class Two:
        def __init__(self) -> None:
            self.a, self.b = FakeLLM(), FakeAsyncLLM()

    with pytest.raises(DestinationError, match="holds 0 vLLM engine attributes"):
        vllm_actor.find_engine(Empty(), None)
    with pytest.raises(DestinationError, match=r"holds 2 vLLM engine attributes \(\['a', 'b'\]\): name one"):
        vllm_actor.find_engine(Two(), None)
    assert isinstance(vllm_actor.find_engine(Two(), "b"), FakeAsyncLLM)
    with pytest.raises(DestinationError, match=r"SyncActor\.engine is not a vllm\.LLM or AsyncLLM"):
        vllm_actor.find_engine(SyncActor(), "engine")


def test_pause_resume_and_version_reach_the_async_engine() -> None:
    actor = AsyncActor()
    for mode in ("keep", "wait", "abort"):
        asyncio.run(actor.weightsync("pause", mode))
    asyncio.run(actor.weightsync("resume"))
    assert actor.engine.calls == [("pause", "keep"), ("pause", "wait"), ("pause", "abort"), ("resume", None)]
    assert asyncio.run(actor.weightsync("version")) == "v7"
    with pytest.raises(DestinationError, match="unknown engine operation 'nope'"):
        asyncio.run(actor.weightsync("nope"))


def _llm_with(client: Any) -> SyncActor:
    actor = SyncActor()
    actor.llm.llm_engine = type("Engine", (), {"engine_core": client})()  # type: ignore[attr-defined]
    return actor


def test_an_llms_failed_engine_is_reported_dead_whichever_process_holds_its_core() -> None:
    """The liveness probe's answer inside the actor: vLLM's core in its own process marks its client's
    resources dead; an in-process core's executor marks itself failed."""
    apart = type("Client", (), {"resources": type("R", (), {"engine_dead": False})()})()
    inproc = type(
        "Client", (), {"engine_core": type("Core", (), {"model_executor": type("X", (), {})()})()}
    )()
    inproc.engine_core.model_executor.is_failed = False
    for client, fail in (
        (apart, lambda: setattr(apart.resources, "engine_dead", True)),
        (inproc, lambda: setattr(inproc.engine_core.model_executor, "is_failed", True)),
    ):
        actor = _llm_with(client)
        assert vllm_actor._llm_call(actor, None, "alive", ()) is True
        fail()
        assert vllm_actor._llm_call(actor, None, "alive", ()) is False


def test_an_async_engines_liveness_is_its_errored_flag() -> None:
    actor = AsyncActor()
    actor.engine.errored = False  # type: ignore[attr-defined]
    assert asyncio.run(actor.weightsync("alive")) is True
    actor.engine.errored = True  # type: ignore[attr-defined]
    assert asyncio.run(actor.weightsync("alive")) is False
