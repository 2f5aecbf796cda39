"""The real `vllm serve` launcher and its clients, under their old name: they live in
sync_runtime.testing.vllm_server (the `--engine vllm-server` demo uses them too)."""

from __future__ import annotations

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
