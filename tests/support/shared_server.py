"""One real `vllm serve` (TP 1, dummy weights, the weightsync backend) and the demo's Megatron-layout
sources at v1, shared by the server modules of a session (tests/engines/test_vllm_server.py,
test_vllm_server_pause.py, test_vllm_server_faults.py' surviving replica) through the
`qwen3_server` fixture of tests/engines/conftest.py (tests/support/shared_engines.py).

The oracle is the reference cache's checkpoint-loaded `VllmReplica` (started only on a miss).
The server's generation on its dummy weights is recorded as soon as it is up, before any sync.
A test that needs to start from weights that are neither the oracle's nor its own push calls
`push_other_weights` first. Each module attaches its own WeightSync proxy and kills it when done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import DemoSetup, train_step
from sync_runtime.testing.vllm_deploy import Generation
from tests.support.vllm_deploy import deploy, destination_ref, sync_spec
from tests.support.vllm_server import Server, generations, launch, stop

NS = "vllm-server-shared"
DST = ParallelSpec.parse("tp=1")
MAX_MODEL_LEN = 512
"""Room for test_vllm_server_pause's 300-token in-flight request (the tiny model's positions)."""
OTHER_SEED = 77
"""`push_other_weights`' weights: neither the oracle's (seed 0) nor a test's scrambled push (99)."""
_pushes = itertools.count()


@dataclass
class SharedServer:
    setup: DemoSetup
    manifest: Manifest
    server: Server
    port: int
    ref: Generation
    """The oracle's generation of PROMPTS (the checkpoint of the sources' v1)."""
    dummy: list[dict[str, list]]
    """The server's generation of PROMPTS on its dummy weights, before any sync."""
    stack: contextlib.ExitStack

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def namespace(self) -> str:
        return self.setup.namespace

    def spec(self, destinations: list[Any], version: str) -> Any:
        return sync_spec(self.setup.model, self.namespace, self.setup.src, destinations, version)

    def push_other_weights(self) -> None:
        """Leave the server on the weights of seed OTHER_SEED (same shapes) and the sources on
        v1: a known starting state that is neither the oracle's nor dummy nor a test's push."""
        n = next(_pushes)
        name, version = f"reset{n}-", f"other-{n}"
        proxy = attach(f"{name}r0", self.namespace, HttpControl(self.url), ranks=1)
        try:
            ray.get(proxy.ws_num_ranks.remote(), timeout=300)
            spec = self.spec([destination_ref("reset", self.namespace, f"{name}r", DST)], version)
            train_step(dataclasses.replace(self.setup, seed=OTHER_SEED), "other")
            coordinator = Coordinator(spec, NullReporter(), manifest=self.manifest)
            try:
                report = coordinator.sync(version)
            finally:
                coordinator.close()
                train_step(self.setup, "v1")
            assert report.result is SyncResult.SUCCEEDED, report.failure
        finally:
            ray.kill(proxy)


def start_shared_server(directory: Path) -> SharedServer:
    stack = contextlib.ExitStack()
    try:
        d = stack.enter_context(
            deploy(
                "qwen3",
                directory / "v1",
                src="tp=2",
                dst=DST,
                namespace=NS,
                engines={},
                references={"ref": ("ref-server", {"tp": 1})},
            )
        )
        server = launch(d.setup.model.rsplit("/", 1)[0], directory / "serve.log", max_model_len=MAX_MODEL_LEN)
        stack.callback(stop, server.proc)
        server.wait()
        port = int(server.url.rsplit(":", 1)[1])
        ref = d.reference_calls[0]["ref"]
        return SharedServer(d.setup, d.manifest, server, port, ref, generations(server.url), stack)
    except BaseException:
        stack.close()
        raise


def server_alive(shared: SharedServer) -> bool:
    if shared.server.proc.poll() is not None:
        return False
    try:
        return httpx.get(f"{shared.url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def stop_shared_server(shared: SharedServer) -> None:
    shared.stack.close()
