"""An `AsyncLLM` inside a user's async Ray actor (how verl, SkyRL and NeMo-RL run rollouts) as a
WeightSync destination, updated in flight while the actor serves concurrent requests.

The actor (`tests/support/vllm_user.py` `AsyncUserEngine`) holds `vllm.AsyncLLMEngine` (V1's
`AsyncLLM`, TP 1, dummy weights) started with `weight_transfer_config={"backend":
"weightsync"}`; from WeightSync it has only the `weightsync` adapter method
(sync_runtime/engines/vllm_actor.py). `ActorControl` drives it through vLLM's public RL API,
with a real pause (`pause_generation(mode="keep")`) around each apply. Sources: the demo's
Megatron-layout actors (tp=2). Oracle: a checkpoint-loaded `VllmReplica` (reference cache).

Three syncs (v1, a scrambled push, v1 again), each while a client thread sends requests to the
actor back to back: every sync commits, no request fails, requests complete during each sync,
generation after v1 and after the resync equals the oracle bit for bit (token ids and every
logprob), before the sync and after the scrambled push it differs on every row (controls), and
vLLM's weight-version spans on the outputs name the synced versions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray

from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.vllm_models import PROMPTS
from tests.support.vllm_deploy import generations, rows_equal
from tests.support.vllm_user import AsyncUserEngine, user_deployment

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-async-actor"
TP = 1
CLIENT_TOKENS = 8


@pytest.fixture(scope="module")
def deployment(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("qwen3async") / "v1"
    with user_deployment(AsyncUserEngine, directory, namespace=NS, prefix="async", tp=TP) as d:
        yield d


@dataclass
class Client:
    """Requests sent to the actor one after another from a thread, as a rollout worker would."""

    user: Any
    done: int = 0
    failed: list[str] = field(default_factory=list)
    versions: list[list[tuple[str, int, int]]] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        k = 0
        while not self.stop.is_set():
            row = list(PROMPTS[k % len(PROMPTS)])
            k += 1
            try:
                _, spans = ray.get(self.user.generate_versioned.remote(row, CLIENT_TOKENS), timeout=120)
            except Exception as e:  # counted, not raised: the test asserts there were none
                self.failed.append(f"{type(e).__name__}: {e}"[:300])
                continue
            self.done += 1
            self.versions.append(spans)
            self.finished_at.append(time.monotonic())


@contextmanager
def serving(user: Any) -> Iterator[Client]:
    """A client sending requests throughout the body (at least one answered before it starts)."""
    client = Client(user)
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while client.done == 0 and not client.failed and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield client
    finally:
        client.stop.set()
        thread.join(150)


def _sync_while_serving(coordinator: Coordinator, user: Any, version: str) -> tuple[Client, int]:
    """Sync `version` with the client running: the client, and its requests answered during the sync."""
    with serving(user) as client:
        t0 = time.monotonic()
        report = coordinator.sync(version)
        t1 = time.monotonic()
        deadline = t1 + 120  # one request answered after the commit, to read its version spans
        while not any(t > t1 for t in client.finished_at) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert report.result is SyncResult.SUCCEEDED, report.failure
    (replica,) = report.replicas
    assert replica.version == version and replica.pause_seconds is not None
    return client, sum(t0 <= t <= t1 for t in client.finished_at)


def test_async_engine_syncs_in_flight_bit_identical_and_no_request_fails(deployment: dict[str, Any]) -> None:
    setup, user, ranks, ref = deployment["setup"], deployment["user"], deployment["ranks"], deployment["ref"]
    (dummy,) = generations([user])
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    clients: list[tuple[Client, int]] = []
    try:
        clients.append(_sync_while_serving(coordinator, user, "v1"))
        (synced,) = generations([user])
        version = ray.get(user.weight_version.remote())
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        clients.append(_sync_while_serving(coordinator, user, "scrambled"))
        (scrambled,) = generations([user])
        train_step(setup, "v1")
        clients.append(_sync_while_serving(coordinator, user, "v1-again"))
        (again,) = generations([user])
    finally:
        coordinator.close()
    for client, during in clients:
        print(
            f"client: {client.done} requests, {len(client.failed)} failed, {during} answered during the sync"
        )
    assert synced == ref  # token ids and every logprob bit
    assert again == ref
    assert version == "v1"  # vLLM's own weight version label, set by finish_weight_update
    assert rows_equal(dummy, ref) == 0  # negative control: before the sync it generates otherwise
    assert rows_equal(scrambled, ref) == 0  # and after a scrambled push
    assert all(not c.failed for c, _ in clients), [c.failed for c, _ in clients]
    assert all(during > 0 for _, during in clients)  # the actor kept serving while each sync ran
    # vLLM's spans on the outputs: the last request of each client (answered after the commit)
    # was sampled with the synced version only; the first of the next one with that same version
    for (client, _), synced_as in zip(clients, ("v1", "scrambled", "v1-again"), strict=True):
        assert {v for v, _, _ in client.versions[-1]} == {synced_as}, client.versions[-1]
    assert {v for v, _, _ in clients[1][0].versions[0]} == {"v1"}
    assert {v for v, _, _ in clients[2][0].versions[0]} == {"scrambled"}
    pauses = ray.get(ranks.pause_seconds.remote())
    assert len(pauses) == 3 and all(0 < p < 60 for p in pauses)  # a real pause around each apply
    assert ray.get(user.weight_version.remote()) == "v1-again"
