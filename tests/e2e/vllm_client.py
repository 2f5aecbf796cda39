"""Clients of tests/e2e/test_vllm_e2e.py's server pods whose requests are accounted by how they ended.

vLLM ends a request in flight at a pause of mode `abort` with finish_reason "abort" (HTTP 200, the
tokens it had sampled before): for a client that is an answer cut short by design, not a failure,
so it is counted apart (`aborted`); any other end than the requested length is a failure.

- `ServingClient`: short greedy requests one after another (`Client`'s pacing), alternately
  `/v1/completions` and `/inference/v1/generate` (whose answers carry the weight versions);
- `LongStreams`: streamed requests of the most tokens the server allows, back to back, so that one
  is in flight whenever the server pauses: under `abort` one of them is cut short;
- `serving_sync`: a sync with both running against each server, and each server's pauses meanwhile
  from its log.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from helpers import wait_for
from vllm_pods import MAX_MODEL_LEN

from sync_runtime.testing.vllm_models import MAX_TOKENS, PROMPTS
from sync_runtime.testing.vllm_server import Client

LONG_TOKENS = MAX_MODEL_LEN - max(len(p) for p in PROMPTS)
PAUSE_CALL = re.compile(r'"POST /pause\?mode=(\w+) HTTP')
"""A `/pause` call in the server's access log (uvicorn's, on by default in `vllm serve`)."""


def pause_calls(server_log: str) -> Counter[str]:
    """How often the server was paused with each mode, from its log."""
    return Counter(PAUSE_CALL.findall(server_log))


def _generate_body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "detokenize": False}
    return {"token_ids": list(prompt), "sampling_params": params, "stream": stream}


class ServingClient(Client):
    """`Client` that reads each answer's finish_reason: "length" is served, "abort" counted in
    `aborted` (the answer arrived, cut short by the pause), anything else raised (a failure)."""

    INTERVAL_S = 0.5
    """Between requests. Back to back (0.1 s) a TP 2 server's two workers kept both of the machine's
    cores busy, and the runtime pod, starved, took 2-3 minutes for its first sync; requests still
    overlap every sync at this pace."""

    def __init__(self, url: str) -> None:
        super().__init__(url, self.INTERVAL_S, completions=True)
        self.aborted = 0

    def _request(self, i: int) -> Any:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2 == 0:
            body = {
                "prompt": list(prompt),
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            }
            r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        else:
            body = _generate_body(prompt, MAX_TOKENS, False)
            r = httpx.post(f"{self.url}/inference/v1/generate", json=body, timeout=120)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        reason = choice.get("finish_reason")
        if reason == "abort":
            self.aborted += 1
            return None
        if reason != "length" or len(choice["token_ids"]) != MAX_TOKENS:
            raise RuntimeError(f"finish_reason {reason!r} after {len(choice['token_ids'])} tokens")
        versions = [span["version"] for span in choice.get("weight_versions") or []]
        self.versions.update(versions)
        return versions


class LongStreams(threading.Thread):
    """Streamed requests of LONG_TOKENS back to back until `stop` is set; `ended` holds each one's
    (finish_reason, tokens received), `errors` the requests that failed."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.streaming = threading.Event()
        """Set once the first request's first tokens arrived."""
        self.ended: list[tuple[str | None, int]] = []
        self.errors: list[str] = []
        self.seconds: list[float] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.ended.append(self._stream(PROMPTS[i % len(PROMPTS)]))
            except Exception as e:
                self.errors.append(repr(e))
                self.stop.wait(1.0)  # not a busy loop against a server that refuses
            self.seconds.append(time.monotonic() - t0)
            i += 1

    def _stream(self, prompt: list[int]) -> tuple[str | None, int]:
        tokens, reason = 0, None
        body = _generate_body(prompt, LONG_TOKENS, True)
        with httpx.stream("POST", f"{self.url}/inference/v1/generate", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: ") :]).get("choices") or []:
                    tokens += len(choice.get("token_ids") or [])
                    reason = choice.get("finish_reason") or reason
                if tokens:
                    self.streaming.set()
        return reason, tokens

    @property
    def aborted(self) -> list[int]:
        """Tokens each aborted request had received."""
        return [n for reason, n in self.ended if reason == "abort"]

    def unexpected(self) -> list[tuple[str | None, int]]:
        """Requests that ended neither at their length nor aborted."""
        return [(r, n) for r, n in self.ended if not (r == "length" and n == LONG_TOKENS) and r != "abort"]


@dataclass
class Load:
    """What one server got during a sync: its clients, and its pauses meanwhile (from its log)."""

    client: ServingClient
    long: LongStreams | None
    pauses: Counter[str]


@dataclass
class Served:
    """One sync under load: the WeightSync after it, and each server's load (in `urls`' order)."""

    obj: dict[str, Any]
    loads: list[Load]


def serving_sync(
    urls: list[str],
    server_logs: list[Callable[[], str]],
    sync: Callable[[], dict[str, Any]],
    version: str,
    *,
    long: bool,
) -> Served:
    """`sync()` (kubectl apply or patch, then wait until Synced: the WeightSync) while a client per
    server keeps sending it requests (and, `long`, long streamed requests run back to back on each),
    then until each server sampled a request with `version`; the clients are stopped before
    returning."""
    before = [pause_calls(log()) for log in server_logs]
    clients = [ServingClient(url) for url in urls]
    streams = [LongStreams(url) for url in urls] if long else []
    for client in clients:
        client.start()
    try:
        for client in clients:
            served = lambda c=client: c.requests > 0  # noqa: E731
            wait_for(f"a request served by {client.url} before the sync", served, 120)
        for stream in streams:
            stream.start()
        for stream in streams:
            wait_for(f"a long request streaming from {stream.url}", stream.streaming.is_set, 120)
        for client in clients:
            client.syncing.set()
        obj = sync()
        for client in clients:
            client.syncing.clear()
        for stream in streams:
            stream.stop.set()
        for client in clients:
            sampled = lambda c=client: version in c.versions  # noqa: E731
            wait_for(f"a request of {client.url} sampled with {version}", sampled, 120)
    finally:
        for client in clients:
            client.stop.set()
        for stream in streams:
            stream.stop.set()
            if stream.ident is not None:
                stream.join(300)  # its request in flight runs to its end
        for client in clients:
            client.join(150)
    pauses = [pause_calls(log()) - b for log, b in zip(server_logs, before, strict=True)]
    longs: list[LongStreams | None] = list(streams) if long else [None] * len(urls)
    return Served(obj, [Load(*x) for x in zip(clients, longs, pauses, strict=True)])
