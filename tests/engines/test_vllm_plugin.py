"""The `weightsync` vLLM plugin: a user's own `vllm.LLM` (no worker extension, no WeightSync
class) started with `weight_transfer_config={"backend": "weightsync"}` becomes destination
ranks, one per worker, driven through vLLM's public weight-transfer API.

Sources: the demo's Megatron-layout actors (tp=2). Destination: `UserEngine`, a plain Ray actor
holding an offline `vllm.LLM` at TP 2 with dummy weights; WeightSync attaches a
`VllmEngineRanks` actor to it. Oracle: our `VllmReplica` loaded from the reference checkpoint.
The backend reaches vLLM's workers only because the installed package declares the
`vllm.general_plugins` entry point (tools/vllm_env.sh installs this clone). The engine's core and
both workers are spawned, as vLLM's CPU platform starts them outside the test session
(`WS_TEST_VLLM_SPAWN=1`, tests/support/session_site): each loads the plugin as a fresh process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.engines.vllm_apply import check_vllm_version
from sync_runtime.errors import DestinationError
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import train_step
from tests.support.vllm_deploy import generations, rows_equal
from tests.support.vllm_user import UserEngine, user_deployment

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-plugin"
TP = 2
DST = ParallelSpec.parse(f"tp={TP}")


@pytest.fixture(scope="module")
def deployment(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("qwen3plugin") / "v1"
    with user_deployment(UserEngine, directory, namespace=NS, prefix="plugin", tp=TP, spawn=True) as d:
        yield d


def test_each_worker_is_one_rank_holding_its_own_shard(deployment: dict[str, Any]) -> None:
    metas = ray.get(deployment["ranks"].ws_meta.remote())
    assert [m.coord.tp_rank for m in metas] == list(range(TP))
    layout = get_layout("vllm")
    for meta in metas:
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = layout.shard(deployment["manifest"], DST, meta.coord)
        assert got == {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}
        assert got["model.layers.0.mlp.down_proj.weight"][0][1] * TP == 512  # half of each row
    assert len({m.pid for m in metas}) == TP  # two worker processes, not the user's actor


def test_sync_is_bit_identical_a_scrambled_push_differs_and_a_resync_restores(
    deployment: dict[str, Any],
) -> None:
    setup, user, ranks, ref = deployment["setup"], deployment["user"], deployment["ranks"], deployment["ref"]
    (dummy,) = generations([user])
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        report = coordinator.sync("v1")
        assert report.result is SyncResult.SUCCEEDED, report.failure
        (synced,) = generations([user])
        version = ray.get(user.weight_version.remote())
        train_step(dataclasses.replace(setup, seed=99), "scrambled")  # other weights, same shapes
        assert coordinator.sync("scrambled").result is SyncResult.SUCCEEDED
        (scrambled,) = generations([user])
        train_step(setup, "v1")
        assert coordinator.sync("v1-again").result is SyncResult.SUCCEEDED
        (again,) = generations([user])
    finally:
        coordinator.close()
    assert synced == ref  # token ids and every logprob bit
    assert again == ref
    assert version == "v1"  # vLLM's own weight version label, set by finish_weight_update
    assert rows_equal(dummy, ref) == 0  # negative control: before the sync it generates otherwise
    assert rows_equal(scrambled, ref) == 0  # and after a scrambled push
    pauses = ray.get(ranks.pause_seconds.remote())
    assert len(pauses) == 3 and all(0 < p < 60 for p in pauses)
    assert ray.get(user.weight_version.remote()) == "v1-again"


def test_an_unknown_vllm_version_is_refused_by_name() -> None:
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.31.2") == "0.31.2"
    with pytest.raises(DestinationError) as e:
        check_vllm_version("0.33.0")
    assert "vLLM 0.33.0 is not a known version (known: 0.31.x, 0.32.x)" in str(e.value)


def test_the_installed_package_declares_the_plugin() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "weightsync"]
    assert ep.value == "sync_runtime.engines.vllm_plugin:register"
    ep.load()()
    ep.load()()  # vLLM may load plugins twice in one process
    engine = WeightTransferEngineFactory._registry["weightsync"]()
    assert engine.__name__ == "WeightSyncEngine"
