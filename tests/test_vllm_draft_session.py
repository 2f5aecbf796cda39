"""An MTP engine's drafter through the weightsync backend: the control side's draft session.

vLLM hands a weight-transfer engine its drafter only inside a draft-model session
(`start_draft_weight_update`), so a worker of an engine speculating with MTP answers init with
DRAFTER_PENDING and becomes a rank on the `ws_setup` the proxy sends in one such session
(engines/vllm_ranks.py, vllm_plugin/backend.py). The control here records the calls and answers
for the workers through the proxy's real control store; the control's routes to vLLM (HTTP,
`LLM`, `AsyncLLM`) are checked against stand-ins. The real engine: tests/engines/test_vllm_mtp.py.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sync_runtime.engines import vllm_actor
from sync_runtime.engines.vllm_drafter import DRAFTER_PENDING
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_plugin import answer_key, args_key, init_key
from sync_runtime.engines.vllm_ranks import VllmEngineRanks
from sync_runtime.errors import DestinationError, DiscoveryError
from tests.support.engine_control import StoreControl, no_ray  # noqa: F401 (no_ray: a fixture)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_ray")]  # no_ray: tests/support/engine_control.py

NO_DRAFTER = "Draft model weight update requested, but no draft model is configured."
"""vLLM 0.32's refusal (gpu_worker._set_draft_weight_update_target) of an engine without one."""


def _meta() -> SimpleNamespace:
    return SimpleNamespace(coord=SimpleNamespace(replica=0))


class DraftControl(StoreControl):
    """EngineControl of a `world`-worker engine; its workers wait for their drafter at init for
    each True of `pending`, and take `ws_setup` only inside a draft session."""

    def __init__(self, pending: tuple[bool, ...] = (True, True), refuse_draft: str = "") -> None:
        super().__init__()
        self.pending, self.refuse_draft = pending, refuse_draft
        self.session: str | None = None

    def world_size(self) -> int:
        return len(self.pending)

    def init(self, info: dict[str, Any]) -> None:
        store = self._connect(info)
        for i, waits in enumerate(self.pending):
            answer = DRAFTER_PENDING if waits else ("ok", _meta())
            store.set(init_key(self.prefix, i), pickle.dumps(answer))

    def start(self) -> None:
        self.calls.append(("start", None))
        self.session = "target"

    def start_draft(self) -> None:
        self.calls.append(("start_draft", None))
        if self.refuse_draft:
            raise RuntimeError(self.refuse_draft)
        self.session = "draft"

    def update(self, info: dict[str, Any]) -> None:
        self.calls.append(("update", info["method"]))
        assert self.store is not None
        in_draft = self.session == "draft"
        for i in range(self.world_size()):
            if info["method"] == "ws_setup":  # what the backend answers, as in _setup_with_drafter
                answer = ("ok", _meta()) if in_draft else ("error", DestinationError("not a draft session"))
            else:
                assert self.store.check([args_key(self.prefix, info["seq"], i)])
                answer = ("ok", True)
            self.store.set(answer_key(self.prefix, info["seq"], i), pickle.dumps(answer))

    def finish(self, version: str | None) -> None:
        self.calls.append(("finish", version))
        self.session = None


def test_an_mtp_engine_is_set_up_in_one_draft_session_then_syncs_in_target_sessions() -> None:
    control = DraftControl()
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    assert control.calls == [("start_draft", None), ("update", "ws_setup"), ("finish", None)]
    control.calls.clear()
    assert len(proxy.ws_meta()) == 2  # the protocol's calls: in target sessions
    assert control.calls == [("start", None), ("update", "ws_meta"), ("finish", None)]


def test_an_engine_without_a_drafter_opens_no_draft_session() -> None:
    control = DraftControl(pending=(False, False))
    VllmEngineRanks(control, host="127.0.0.1")
    assert control.calls == []  # set up at init, as before


def test_a_setup_outside_a_draft_session_is_refused_by_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control of the sequencing: were ws_setup sent in a target session, the worker's
    # refusal reaches the caller (the fake answers as the backend does).
    control = DraftControl()
    monkeypatch.setattr(control, "start_draft", control.start)
    with pytest.raises(DestinationError, match="not a draft session"):
        VllmEngineRanks(control, host="127.0.0.1")


def test_a_refused_draft_session_refuses_the_engine_in_one_line() -> None:
    control = DraftControl(refuse_draft=f"Traceback ...\nRuntimeError: {NO_DRAFTER}")
    with pytest.raises(DestinationError) as e:
        VllmEngineRanks(control, host="127.0.0.1")
    msg = str(e.value)
    assert "\n" not in msg and "speculates with MTP" in msg and NO_DRAFTER in msg
    assert control.calls == [("start_draft", None)]  # nothing sent, no session left open


def test_workers_disagreeing_on_a_drafter_are_refused() -> None:
    with pytest.raises(DiscoveryError, match="1 of 2 wait for an MTP drafter"):
        VllmEngineRanks(DraftControl(pending=(True, False)), host="127.0.0.1")


def test_a_draft_session_left_open_is_closed_and_reopened() -> None:
    control = DraftControl()
    opened = control.start_draft

    def once_already_active() -> None:
        if not any(c == ("finish", None) for c in control.calls):
            control.calls.append(("start_draft", None))
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        opened()

    control.start_draft = once_already_active  # type: ignore[method-assign]
    VllmEngineRanks(control, host="127.0.0.1")
    assert control.calls == [
        ("start_draft", None),
        ("finish", None),
        ("start_draft", None),
        ("update", "ws_setup"),
        ("finish", None),
    ]


# ---- the control's route to vLLM's draft session -------------------------------------------


class FakeLLM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_draft_weight_update(self) -> None:
        self.calls.append("start_draft_weight_update")


class FakeAsyncLLM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start_draft_weight_update(self) -> None:
        self.calls.append("start_draft_weight_update")


def test_actor_engines_open_vllms_draft_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_actor, "_engine_classes", lambda: (FakeLLM, FakeAsyncLLM))
    holder = SimpleNamespace(llm=FakeLLM())
    vllm_actor._llm_call(holder, None, "start_draft", ())
    assert holder.llm.calls == ["start_draft_weight_update"]
    engine = FakeAsyncLLM()
    asyncio.run(vllm_actor.weightsync_control(engine, "start_draft"))
    assert engine.calls == ["start_draft_weight_update"]


def test_a_server_opens_vllms_draft_session_route() -> None:
    seen: list[tuple[str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.content))
        return httpx.Response(200, content=json.dumps({"message": "Draft weight update started"}))

    control = HttpControl("http://vllm:8000")
    control._client = httpx.Client(transport=httpx.MockTransport(handler))
    control.start_draft()
    assert seen == [("POST", "/start_draft_weight_update", b"")]
