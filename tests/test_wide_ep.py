"""vLLM's wide EP as a destination: `vllm serve --data-parallel-size D --enable-expert-parallel`.

The server's D engines are one replica: experts are split over all D*TP ranks (EP rank
dp_rank * tp + tp_rank, vLLM's FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp), everything
else is TP-sharded and identical on every DP rank. Declared as destination parallelism
`tp=T, dp=D, ep=T*D` (CRD: plus `vllmServers.dataParallelSize: D`). Pure parts here: the
topology's enumeration and refusals, the vllm layout's shards at DP ranks, the CRD rules, the
attacher (replica per pod, a server laid out otherwise refused naming the pod) and the worker's
coordinates. Plans: tests/test_planner_properties.py (wide EP cases). The real server:
tests/engines/test_vllm_server_wide_ep.py.
"""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.engines import vllm_servers
from sync_runtime.engines.vllm_apply import check_expert_placement
from sync_runtime.engines.vllm_plugin import answer_key, args_key, init_key
from sync_runtime.engines.vllm_ranks import VllmEngineRanks
from sync_runtime.engines.vllm_worker import check_wide_ep, is_wide_ep
from sync_runtime.errors import DestinationError, LayoutError, TopologyError, TopologyMismatchError
from sync_runtime.kube.pods import ServerPod
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.crd import (
    MSG_DEST_DP,
    MSG_DEST_EP,
    MSG_SERVERS_DP,
    MSG_SERVERS_WIDE_EP,
    spec_problems,
)
from tests.support.engine_control import StoreControl, no_ray  # noqa: F401 (no_ray: a fixture)
from tests.support.specs import servers_spec

pytestmark = pytest.mark.unit
WIDE = ParallelSpec.parse("tp=2,dp=2,ep=4,replicas=2")
L0 = "model.layers.0."  # a MoE layer (tiny-qwen3-moe: layer 1 is dense)
W13 = L0 + "mlp.experts.routed_experts.w13_weight"
QKV = L0 + "self_attn.qkv_proj.weight"


def test_ranks_are_in_the_workers_order_with_vllms_ep_rank() -> None:
    # vllm_worker._worker_coord: local index dp_rank * tp*pp + pp_rank * tp + tp_rank
    coords = enumerate_ranks(WIDE, Role.DESTINATION)
    got = [(c.replica, c.dp_rank, c.tp_rank, c.ep_rank) for c in coords]
    assert got == [(r, d, t, d * 2 + t) for r in range(2) for d in range(2) for t in range(2)]
    assert WIDE.ranks_per_replica == 4 and WIDE.world_size == len(coords) == 8
    assert len({c.key for c in coords}) == 8
    plain = enumerate_ranks(ParallelSpec.parse("tp=2,ep=2"), Role.DESTINATION)  # EP inside TP
    assert [(c.dp_rank, c.ep_rank) for c in plain] == [(0, 0), (0, 1)]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("tp=2,dp=2", "needs ep=tp*dp=4 and pp=1 (got ep=1, pp=1)"),
        ("tp=2,dp=2,ep=2", "needs ep=tp*dp=4 and pp=1 (got ep=2, pp=1)"),
        ("tp=1,dp=2,ep=2,pp=2", "needs ep=tp*dp=2 and pp=1 (got ep=2, pp=2)"),
    ],
)
def test_a_destination_dp_other_than_wide_ep_is_refused_in_one_line(spec: str, fragment: str) -> None:
    with pytest.raises(TopologyError) as e:
        enumerate_ranks(ParallelSpec.parse(spec), Role.DESTINATION)
    assert fragment in e.value.message and "\n" not in e.value.message


def test_experts_are_cut_by_ep_rank_and_dense_tensors_by_tp_rank() -> None:
    config = load_model_config("tiny-qwen3-moe")
    manifest = build_manifest(config)
    experts = config["num_experts"]
    layout = get_layout("vllm")
    layout.validate(manifest, WIDE)
    shards = {
        (c.dp_rank, c.tp_rank): layout.shard(manifest, WIDE, c)
        for c in enumerate_ranks(WIDE, Role.DESTINATION)
        if c.replica == 0
    }
    owned: dict[tuple[int, int], list[int]] = {}
    for key, shard in shards.items():
        shapes = {t.name: t.shape for t in shard.tensors}
        assert shapes[W13][0] == experts // 4
        owned[key] = sorted(
            int(p.tensor.split(".experts.")[1].split(".")[0])
            for p in shard.pieces
            if p.local_name == W13 and p.tensor.endswith("gate_proj.weight")
        )
    per = experts // 4
    for (dp, tp), ids in owned.items():  # vLLM's linear placement: contiguous, by ep_rank
        ep = dp * 2 + tp
        assert ids == list(range(ep * per, (ep + 1) * per)), (dp, tp)

    def dense(dp: int, tp: int) -> list[tuple[str, Any]]:
        return sorted((p.tensor, p.canon_box) for p in shards[dp, tp].pieces if p.local_name == QKV)

    assert dense(0, 0) == dense(1, 0) and dense(0, 1) == dense(1, 1)  # same slice on every DP rank
    assert dense(0, 0) != dense(0, 1)  # cut by tp_rank


def test_the_layout_refuses_experts_not_divisible_by_tp_times_dp() -> None:
    config = {**load_model_config("tiny-qwen3-moe"), "num_experts": 6}
    with pytest.raises(LayoutError, match="E=6 not divisible by ep=4"):
        get_layout("vllm").validate(build_manifest(config), ParallelSpec.parse("tp=2,dp=2,ep=4"))


def test_the_crd_rules_accept_wide_ep_declared_with_dp() -> None:
    where = "spec.destinations[0]"
    assert spec_problems(servers_spec({"tp": 2, "dp": 2, "ep": 4, "replicas": 3}, 2)) == []
    assert spec_problems(servers_spec({"tp": 2, "dp": 2, "ep": 4}, 4)) == [f"{where}: {MSG_SERVERS_WIDE_EP}"]
    assert spec_problems(servers_spec({"tp": 2, "dp": 2, "ep": 2}, 2)) == [f"{where}: {MSG_DEST_DP}"]
    assert spec_problems(servers_spec({"tp": 2, "dp": 2, "ep": 4, "pp": 2}, 2)) == [f"{where}: {MSG_DEST_DP}"]
    assert spec_problems(servers_spec({"tp": 4, "ep": 2}, 1)) == [f"{where}: {MSG_DEST_EP}"]
    assert spec_problems(servers_spec({"replicas": 3}, 2)) == [f"{where}: {MSG_SERVERS_DP}"]
    assert servers_spec({"tp": 1, "dp": 2, "ep": 2}, 2).destinations[0].parallelism.to_spec() == (
        ParallelSpec.parse("tp=1,dp=2,ep=2")
    )


class FakeServer:
    def __init__(self, url: str, world: int = 2, dp: int = 2, wide: bool = True) -> None:
        self.url, self.world, self.dp, self.wide = url, world, dp, wide

    def world_size(self) -> int:
        return self.world

    def data_parallel_size(self) -> int:
        return self.dp


@pytest.mark.usefixtures("no_ray")
def test_the_attacher_makes_each_wide_ep_pod_one_replica_and_refuses_a_dp_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attached: list[tuple[str, int, int]] = []
    killed: list[Any] = []
    servers: dict[str, FakeServer] = {}

    def attach(name: str, namespace: str, control: Any, *, replica: int, pause: str, ranks: int) -> Any:
        attached.append((control.url, replica, ranks))
        # the workers' replicas (vllm_worker._worker_coord): one with wide EP, else one per DP engine
        replicas = [replica] * ranks if control.wide else [replica + i for i in range(ranks)]
        metas = [SimpleNamespace(coord=SimpleNamespace(replica=r)) for r in replicas]
        return SimpleNamespace(ws_meta=SimpleNamespace(remote=lambda: metas))

    monkeypatch.setattr(vllm_servers, "HttpControl", lambda url: servers.setdefault(url, FakeServer(url)))
    monkeypatch.setattr(vllm_servers, "attach", attach)
    monkeypatch.setattr(vllm_servers, "_kill", killed.append)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    pods = [ServerPod(name=f"vllm-{i}", uid=f"uid-{i}", ip=f"10.0.0.{i + 1}", ready=True) for i in range(2)]
    ref = servers_spec({"tp": 1, "dp": 2, "ep": 2, "replicas": 2}, 2).destinations[0]
    vllm_servers.ServerAttacher("team-a", "policy", list_pods=lambda ns, labels: pods)(ref)
    assert attached == [("http://10.0.0.1:8000", 0, 2), ("http://10.0.0.2:8000", 1, 2)]
    servers.clear()
    servers["http://10.0.0.1:8000"] = FakeServer(
        "http://10.0.0.1:8000", wide=False
    )  # no --enable-expert-parallel
    with pytest.raises(TopologyMismatchError) as e:
        vllm_servers.ServerAttacher("team-a", "policy", list_pods=lambda ns, labels: pods)(ref)
    assert e.value.message == (
        "deployment 'rollout': vLLM server pod vllm-0 runs whole model copies on its 2 data-parallel "
        "engines, the destination declares wide EP (parallelism.dp=2)"
    )
    assert len(killed) == 1  # the refused server's proxy is not kept


def test_a_wide_ep_server_declared_as_dp_replicas_is_named() -> None:
    assert vllm_servers.expert_layout_problem("rollout", "vllm-1", 2, False, 1) == (
        "deployment 'rollout': vLLM server pod vllm-1 runs expert parallel across its 2 data-parallel "
        "engines, the destination declares one replica per DP engine (parallelism.dp=1)"
    )
    assert vllm_servers.expert_layout_problem("rollout", "vllm-1", 2, False, 2) is None
    assert vllm_servers.expert_layout_problem("rollout", "vllm-1", 1, False, 1) is None


def test_the_worker_sees_wide_ep_and_refuses_it_with_pipeline_stages() -> None:
    def config(ep: bool, dp: int, pp: int = 1) -> Any:
        parallel = SimpleNamespace(
            enable_expert_parallel=ep, data_parallel_size=dp, pipeline_parallel_size=pp
        )
        return SimpleNamespace(parallel_config=parallel)

    assert (
        is_wide_ep(config(True, 2)) and not is_wide_ep(config(True, 1)) and not is_wide_ep(config(False, 2))
    )
    check_wide_ep(config(True, 2))
    check_wide_ep(config(False, 2, pp=2))  # DP replicas with PP: not wide EP
    with pytest.raises(DestinationError) as e:
        check_wide_ep(config(True, 2, pp=2))
    assert "with 2 pipeline stages is not supported" in e.value.message and "\n" not in e.value.message


def test_only_vllms_fixed_linear_expert_placement_is_accepted() -> None:
    def config(**kw: Any) -> Any:
        base = {"enable_expert_parallel": True, "expert_placement_strategy": "linear", "enable_eplb": False}
        return SimpleNamespace(parallel_config=SimpleNamespace(**{**base, **kw}))

    check_expert_placement(config())
    check_expert_placement(config(enable_expert_parallel=False, enable_eplb=True))  # no EP: no experts move
    with pytest.raises(DestinationError, match="needs 'linear'"):
        check_expert_placement(config(expert_placement_strategy="round_robin"))
    with pytest.raises(DestinationError, match="no EPLB"):
        check_expert_placement(config(enable_eplb=True))


class WideEpControl(StoreControl):
    """A wide-EP server of two DP engines (one worker each) that report one replica together, as
    the weightsync backend's workers do (vllm_worker._worker_coord); each records what it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[tuple[int, str]] = []

    def world_size(self) -> int:
        return 2

    def init(self, info: dict[str, Any]) -> None:
        store = self._connect(info)
        for i in range(2):
            meta = SimpleNamespace(coord=SimpleNamespace(replica=info["replica"]))
            store.set(init_key(self.prefix, i), pickle.dumps(("ok", meta)))

    def update(self, info: dict[str, Any]) -> None:
        self.calls.append(("update", info["method"]))
        assert self.store is not None
        for i in range(2):
            key = args_key(self.prefix, info["seq"], i)
            answer: tuple[str, Any] = ("skip", None)
            if self.store.check([key]):
                self.ran.append((i, info["method"]))
                answer = ("ok", True)
            self.store.set(answer_key(self.prefix, info["seq"], i), pickle.dumps(answer))


@pytest.mark.usefixtures("no_ray")
def test_the_proxy_pauses_applies_and_resumes_both_dp_engines_as_one_replica() -> None:
    # runtime/commit.py drives one replica: its ranks' calls arrive apart, the proxy batches them
    # (the replica's two ranks): one /pause before either applies, one apply call reaching both
    # engines, one /resume after both hold the version: no forward on a half-applied model
    control = WideEpControl()
    proxy = VllmEngineRanks(control, replica=3, host="127.0.0.1")

    def each_rank(method: str, args: tuple = ()) -> list[Any]:
        out: list[Any] = [None, None]

        def call(i: int) -> None:
            out[i] = proxy.ws_rank_call(i, method, args)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    assert each_rank("ws_pause") == [True, True]
    assert each_rank("ws_commit", ("v2",)) == [True, True]
    assert each_rank("ws_resume", ("v2",)) == [True, True]
    updates = [c for c in control.calls if c[0] in ("pause", "resume", "update")]
    assert updates == [
        ("pause", "keep"),
        ("update", "ws_pause"),
        ("update", "ws_commit"),
        ("update", "ws_resume"),
        ("resume", None),
    ]
    assert control.ran == [(i, m) for m in ("ws_pause", "ws_commit", "ws_resume") for i in range(2)]
    assert ("finish", "v2") in control.calls and len(proxy.pause_seconds()) == 1
