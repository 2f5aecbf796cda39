"""The real `vllm serve` launcher and its clients, under their old name: they live in
sync_runtime.testing.vllm_server (the `--engine vllm-server` demo uses them too)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.testing.vllm_server import (
    START_TIMEOUT_S,
    Client,
    Server,
    complete,
    completions,
    free_port,
    generate,
    generations,
    launch,
    serve,
    stop,
    wait_healthy,
)

__all__ = [
    "START_TIMEOUT_S",
    "Client",
    "Server",
    "attached",
    "complete",
    "completions",
    "free_port",
    "generate",
    "generations",
    "launch",
    "serve",
    "stop",
    "wait_healthy",
]


@contextlib.contextmanager
def attached(
    server: Server,
    name: str,
    namespace: str,
    *,
    ranks: int,
    control: Callable[[str], Any] = HttpControl,
) -> Iterator[tuple[str, Any]]:
    """Wait for `server`, attach WeightSync's proxy `name` to it as replica 0 (`ranks` workers,
    through `control(url)`), yield (url, proxy); on exit kill the proxy, then stop the server
    (also when the wait or the attach failed)."""
    proxy = None
    try:
        started = time.monotonic()
        url = server.wait()
        print(f"{name}: server healthy in {time.monotonic() - started:.1f} s")
        proxy = attach(name, namespace, control(url), replica=0, ranks=ranks)
        yield url, proxy
    finally:
        if proxy is not None:
            ray.kill(proxy)
        stop(server.proc)
