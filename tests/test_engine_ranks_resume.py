"""engines/vllm_ranks.VllmEngineRanks: the calls a pause and a resume make on vLLM's control surface.

The resume's own weight-update session labels the engine with the version (one session: start,
update, finish(version), then resume), only when every local rank resumed on that version.
The control here records the calls and answers for the worker through the proxy's real
control store, as the weightsync backend does (vllm_plugin/backend.py).
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from sync_runtime.engines.vllm_plugin import answer_key, args_key, init_key
from sync_runtime.engines.vllm_ranks import VllmEngineRanks
from tests.support.engine_control import StoreControl, no_ray  # noqa: F401 (no_ray: a fixture)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_ray")]  # no_ray: tests/support/engine_control.py


class RecordingControl(StoreControl):
    """EngineControl of a one-worker engine whose worker answers `resume_ok` to ws_resume."""

    def __init__(self, resume_ok: bool = True) -> None:
        super().__init__()
        self.resume_ok = resume_ok

    def world_size(self) -> int:
        return 1

    def init(self, info: dict[str, Any]) -> None:
        meta = SimpleNamespace(coord=SimpleNamespace(replica=info["replica"]))
        self._connect(info).set(init_key(self.prefix, 0), pickle.dumps(("ok", meta)))

    def update(self, info: dict[str, Any]) -> None:
        self.calls.append(("update", info["method"]))
        assert self.store is not None
        self.store.get(args_key(self.prefix, info["seq"], 0))
        answer = self.resume_ok if info["method"] == "ws_resume" else True
        self.store.set(answer_key(self.prefix, info["seq"], 0), pickle.dumps(("ok", answer)))


def test_resume_labels_the_version_in_its_own_session() -> None:
    control = RecordingControl()
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    assert proxy.ws_rank_call(0, "ws_pause", ()) is True
    assert control.calls == [("start", None), ("pause", "keep"), ("update", "ws_pause"), ("finish", None)]
    control.calls.clear()
    assert proxy.ws_rank_call(0, "ws_resume", ("v3",)) is True
    # before: start, update, finish(None), then start, finish("v3") in a second session, resume
    assert control.calls == [("start", None), ("update", "ws_resume"), ("finish", "v3"), ("resume", None)]
    assert len(proxy.pause_seconds()) == 1 and proxy.ws_pause_seconds() is not None


def test_a_rank_that_does_not_resume_keeps_the_label_and_the_pause() -> None:
    control = RecordingControl(resume_ok=False)
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    proxy.ws_rank_call(0, "ws_pause", ())
    control.calls.clear()
    assert proxy.ws_rank_call(0, "ws_resume", ("v3",)) is False
    assert control.calls == [("start", None), ("update", "ws_resume"), ("finish", None)]  # no resume
    assert proxy.pause_seconds() == [] and proxy.ws_pause_seconds() is None


def test_a_rank_of_unknown_version_resumes_and_keeps_the_engines_label() -> None:
    # A proxy attached to a server another proxy synced sets its rank up on version '' (unknown):
    # the recovery's resume must resume generation but not label the engine '' (the label vLLM
    # reports would otherwise be lost; tests/engines/test_vllm_server_faults.py).
    control = RecordingControl()
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    proxy.ws_rank_call(0, "ws_pause", ())
    control.calls.clear()
    assert proxy.ws_rank_call(0, "ws_resume", ("",)) is True
    assert control.calls == [("start", None), ("update", "ws_resume"), ("finish", None), ("resume", None)]
    assert len(proxy.pause_seconds()) == 1
