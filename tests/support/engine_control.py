"""A stand-in for `EngineControl` (engines/vllm_ranks.py) in unit tests of the vLLM proxy: it
records the calls the proxy makes on vLLM's control surface and reaches the proxy's real
control store as the weightsync backend's workers do (vllm_plugin/backend.py). Subclasses say
how the workers answer init and each update."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch.distributed as dist

from sync_runtime.engines.vllm_ranks import one_update_session


class StoreControl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.store: dist.TCPStore | None = None
        self.prefix = ""

    def _connect(self, info: dict[str, Any]) -> dist.TCPStore:
        """The proxy's control store, as the workers join it at init."""
        self.store = dist.TCPStore(info["store_host"], info["store_port"], is_master=False)
        self.prefix = info["prefix"]
        return self.store

    def start(self) -> None:
        self.calls.append(("start", None))

    def finish(self, version: str | None) -> None:
        self.calls.append(("finish", version))

    def one_update(self, update_info: dict[str, Any]) -> None:
        one_update_session(self.start, self.update, self.finish, update_info)  # type: ignore[attr-defined]

    def pause(self, mode: str) -> None:
        self.calls.append(("pause", mode))

    def resume(self) -> None:
        self.calls.append(("resume", None))

    def version(self) -> str:
        return ""

    def alive(self) -> bool:
        return True


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy outside a Ray actor: no runtime context (and no local Ray started for one)."""
    ctx = SimpleNamespace(get_actor_name=lambda: None, get_actor_id=lambda: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
