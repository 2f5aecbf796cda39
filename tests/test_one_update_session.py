"""One WeightSync call = one vLLM weight-update session holding one update
(`vllm_ranks.one_update_session`), run where the engine is: in one call of a user's `LLM` actor
(`ActorControl`), as three requests to a server (`HttpControl`). The proxy around it:
tests/test_vllm_draft_session.py; the async actor's awaited twin: tests/engines/test_vllm_async_actor.py."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sync_runtime.engines import vllm_actor
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import one_update_session

pytestmark = pytest.mark.unit
ALREADY = "start_weight_update called while a weight update is already active."


class Session:
    """Records the three calls; `fail_start` / `fail_update` raise on their first call."""

    def __init__(self, fail_start: str = "", fail_update: str = "") -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_start, self.fail_update = fail_start, fail_update

    def start(self) -> None:
        self.calls.append(("start", None))
        if self.fail_start:
            reason, self.fail_start = self.fail_start, ""
            raise RuntimeError(reason)

    def update(self, info: dict[str, Any]) -> None:
        self.calls.append(("update", info["method"]))
        if self.fail_update:
            raise RuntimeError(self.fail_update)

    def finish(self, version: str | None) -> None:
        self.calls.append(("finish", version))

    def run(self) -> None:
        one_update_session(self.start, self.update, self.finish, {"seq": 1, "method": "ws_meta"})


def test_one_update_in_one_session_keeping_the_label() -> None:
    s = Session()
    s.run()
    assert s.calls == [("start", None), ("update", "ws_meta"), ("finish", None)]


def test_a_session_left_open_is_closed_then_opened_again() -> None:
    s = Session(fail_start=ALREADY)
    s.run()
    assert s.calls == [
        ("start", None),
        ("finish", None),
        ("start", None),
        ("update", "ws_meta"),
        ("finish", None),
    ]


def test_a_failed_update_closes_the_session_and_raises() -> None:
    s = Session(fail_update="worker 1 died")
    with pytest.raises(RuntimeError, match="worker 1 died"):
        s.run()
    assert s.calls == [("start", None), ("update", "ws_meta"), ("finish", None)]


def test_another_refusal_to_start_is_raised_before_any_update() -> None:
    s = Session(fail_start="no weight transfer engine")
    with pytest.raises(RuntimeError, match="no weight transfer engine"):
        s.run()
    assert s.calls == [("start", None)]


class FakeLLM:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, request: dict[str, Any]) -> None:
        self.calls.append(("update", request["update_info"]["method"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def test_a_user_llm_actor_runs_the_whole_session_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_actor, "_engine_classes", lambda: (FakeLLM, type(None)))
    holder = SimpleNamespace(llm=FakeLLM())
    vllm_actor._llm_call(holder, None, "one_update", ({"seq": 3, "method": "ws_run"},))
    assert holder.llm.calls == [("start", None), ("update", "ws_run"), ("finish", None)]


def test_a_server_gets_the_three_routes_in_order() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content) if request.content else None))
        return httpx.Response(200, content=json.dumps({}))

    control = HttpControl("http://vllm:8000")
    control._client = httpx.Client(transport=httpx.MockTransport(handler))
    control.one_update({"seq": 2, "method": "ws_commit"})
    assert seen == [
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": {"seq": 2, "method": "ws_commit"}}),
        ("/finish_weight_update", {"weight_version": None}),
    ]
