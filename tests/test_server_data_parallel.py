"""A data-parallel `vllm serve` (`--data-parallel-size D`) as a destination: its D engines are
replicas of their own behind one proxy, committed together and paused once.

The proxy here is the real `VllmEngineRanks` with a stand-in control whose two workers (DP ranks
0 and 1 of one server, TP 1) answer through the proxy's real control store, as the weightsync
backend's workers do. The commit phase (runtime/commit.py) pauses, commits and resumes all
replicas of one engine together (`engines_of`); the server must resume only when every DP rank
resumes on one version, be labelled with it once, and otherwise stay paused with none of its
replicas reporting serving (a DP engine left out, DP ranks on different versions). The pure parts
of the attacher's refusals and the CRD rule are checked too. The real server is in
tests/engines/test_vllm_server_dp.py; wide EP (the DP engines one replica): tests/test_wide_ep.py.
"""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from sync_runtime.engines import vllm_batch, vllm_servers
from sync_runtime.engines.vllm_batch import Batch, RankBatcher, gather_seconds
from sync_runtime.engines.vllm_plugin import answer_key, args_key, init_key
from sync_runtime.engines.vllm_ranks import VllmEngineRanks, check_replicas
from sync_runtime.errors import DiscoveryError, TopologyMismatchError
from sync_runtime.kube.pods import ServerPod, replica_count_problem, world_size_problem
from sync_runtime.runtime import commit
from sync_runtime.runtime.commit import Dest, engines_of, replica_failure
from sync_runtime.runtime.discovery import RankHandle
from sync_runtime.schema.crd import MSG_SERVERS_DP, spec_problems
from sync_runtime.schema.report import ReplicaState, ReplicaVersion
from tests.support.engine_control import StoreControl, no_ray  # noqa: F401 (no_ray: a fixture)
from tests.support.specs import servers_spec

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_ray")]


class DataParallelControl(StoreControl):
    """A server of `dp` engines (one worker each) whose DP rank i holds `holds[i]`."""

    def __init__(self, dp: int = 2) -> None:
        super().__init__()
        self.dp = dp
        self.holds = [""] * dp

    def world_size(self) -> int:
        return self.dp

    def init(self, info: dict[str, Any]) -> None:
        store = self._connect(info)
        for i in range(self.dp):  # DP rank i is replica info["replica"] + i (vllm_worker._worker_coord)
            meta = SimpleNamespace(coord=SimpleNamespace(replica=info["replica"] + i))
            store.set(init_key(self.prefix, i), pickle.dumps(("ok", meta)))

    def update(self, info: dict[str, Any]) -> None:
        self.calls.append(("update", info["method"]))
        assert self.store is not None
        for i in range(self.dp):
            key = args_key(self.prefix, info["seq"], i)
            if not self.store.check([key]):
                answer: tuple[str, Any] = ("skip", None)  # not in this batch
            elif info["method"] == "ws_resume":
                (version,) = pickle.loads(self.store.get(key))
                answer = ("ok", version == self.holds[i])
            else:
                answer = ("ok", True)
            self.store.set(answer_key(self.prefix, info["seq"], i), pickle.dumps(answer))


def engine_calls(control: DataParallelControl) -> list[tuple[str, Any]]:
    return [c for c in control.calls if c[0] in ("pause", "resume") or (c[0] == "finish" and c[1])]


def each_rank(proxy: VllmEngineRanks, method: str, args: dict[int, tuple]) -> list[Any]:
    """`method` on the given local ranks at once, as the commit phase calls them (call_each)."""
    with ThreadPoolExecutor(len(args)) as pool:
        futures = [pool.submit(proxy.ws_rank_call, i, method, a) for i, a in args.items()]
        return [f.result() for f in futures]


def test_dp_replicas_committed_together_pause_and_label_the_server_once() -> None:
    control = DataParallelControl()
    proxy = VllmEngineRanks(control, replica=4, host="127.0.0.1")
    assert proxy.ws_num_ranks() == 2
    assert each_rank(proxy, "ws_pause", {0: (), 1: ()}) == [True, True]
    control.holds = ["v2", "v2"]
    assert each_rank(proxy, "ws_resume", {0: ("v2",), 1: ("v2",)}) == [True, True]
    assert engine_calls(control) == [("pause", "keep"), ("finish", "v2"), ("resume", None)]
    assert len(proxy.pause_seconds()) == 1 and proxy.ws_pause_seconds() is not None


def test_a_dp_replica_resumed_without_the_other_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    # DP rank 1's replica does not hold one version, so the commit phase resumes only DP rank 0:
    # the server stays paused, and DP rank 0 must not report serving either
    monkeypatch.setattr(vllm_batch, "RESUME_WINDOW_S", 0.2)
    control = DataParallelControl()
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    each_rank(proxy, "ws_pause", {0: (), 1: ()})
    control.holds[0] = "v2"
    assert each_rank(proxy, "ws_resume", {0: ("v2",)}) == [False]
    assert engine_calls(control) == [("pause", "keep")]
    assert proxy.ws_pause_seconds() is None
    # the next sync brings both to v2: the server resumes, labelled once
    each_rank(proxy, "ws_pause", {0: (), 1: ()})
    control.holds[1] = "v2"
    assert each_rank(proxy, "ws_resume", {0: ("v2",), 1: ("v2",)}) == [True, True]
    assert engine_calls(control) == [("pause", "keep"), ("finish", "v2"), ("resume", None)]


def test_dp_ranks_on_different_versions_keep_the_server_paused() -> None:
    # DP rank 1 kept v1 (its apply was refused), so the server would serve v2 and v1 under one
    # label: it stays paused and neither DP rank reports serving
    control = DataParallelControl()
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    each_rank(proxy, "ws_pause", {0: (), 1: ()})
    control.holds = ["v2", "v1"]
    assert each_rank(proxy, "ws_resume", {0: ("v2",), 1: ("v1",)}) == [False, False]
    assert engine_calls(control) == [("pause", "keep")]
    each_rank(proxy, "ws_pause", {0: (), 1: ()})
    control.holds[1] = "v2"
    assert each_rank(proxy, "ws_resume", {0: ("v2",), 1: ("v2",)}) == [True, True]
    assert engine_calls(control) == [("pause", "keep"), ("finish", "v2"), ("resume", None)]


def test_both_dp_replicas_in_one_batch_resume_as_one_engine() -> None:
    control = DataParallelControl()
    proxy = VllmEngineRanks(control, host="127.0.0.1")
    control.holds = ["v3", "v3"]
    assert proxy._rpc("ws_pause", {0: (), 1: ()}) == [("ok", True), ("ok", True)]
    batch = SimpleNamespace(method="ws_resume", args={0: ("v3",), 1: ("v3",)})
    batch.results = proxy._rpc("ws_resume", batch.args)
    proxy._after_batch(batch)  # type: ignore[arg-type]
    assert engine_calls(control) == [("pause", "keep"), ("finish", "v3"), ("resume", None)]


def test_workers_must_report_consecutive_replicas_of_equal_size() -> None:
    check_replicas([0], 0)
    check_replicas([4, 4, 5, 5], 4)  # DP 2 x TP 2 from replica 4
    for reported, first in (([0, 0, 1], 0), ([1, 1], 0), ([0, 2], 0), ([0, 1, 0], 0)):
        with pytest.raises(DiscoveryError, match="workers report replicas"):
            check_replicas(reported, first)


def test_the_server_dp_and_world_size_are_checked_against_the_declaration() -> None:
    assert world_size_problem("rollout", "vllm-0", 4, 2, 1, dp=2, server_dp=2) is None
    assert world_size_problem("rollout", "vllm-0", 2, 1, 1, dp=1, server_dp=2) == (
        "deployment 'rollout': vLLM server pod vllm-0 runs 2 data-parallel engine(s), "
        "the destination declares dataParallelSize=1"
    )
    assert world_size_problem("rollout", "vllm-0", 2, 2, 1, dp=2, server_dp=2) == (
        "deployment 'rollout': vLLM server pod vllm-0 runs 2 worker(s), "
        "the declared parallelism needs tp*pp*dp = 2*1*2 = 4"
    )
    pods = [ServerPod(name=f"vllm-{i}", uid=str(i), ip="10.0.0.1", ready=True) for i in range(2)]
    assert replica_count_problem("rollout", "app=vllm", pods, 4, dp=2) is None
    assert replica_count_problem("rollout", "app=vllm", pods[:1], 4, dp=2) == (
        "deployment 'rollout': 1 Ready vLLM server pod(s) x dataParallelSize=2 match 'app=vllm', "
        "expected replicas=4"
    )


def test_replicas_must_be_a_multiple_of_the_servers_dp() -> None:
    assert spec_problems(servers_spec({"replicas": 4}, 2)) == []
    assert spec_problems(servers_spec({"replicas": 3}, 2)) == [f"spec.destinations[0]: {MSG_SERVERS_DP}"]


class FakeServer:
    def __init__(self, url: str, world: int = 2, dp: int = 2) -> None:
        self.url, self.world, self.dp = url, world, dp

    def world_size(self) -> int:
        return self.world

    def data_parallel_size(self) -> int:
        return self.dp


def test_the_attacher_gives_each_pod_its_dp_replicas_and_refuses_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attached: list[tuple[str, int, int]] = []
    servers: dict[str, FakeServer] = {}

    def attach(name: str, namespace: str, control: Any, *, replica: int, pause: str, ranks: int) -> Any:
        attached.append((control.url, replica, ranks))
        metas = [SimpleNamespace(coord=SimpleNamespace(replica=replica + i)) for i in range(ranks)]
        return SimpleNamespace(
            ws_num_ranks=SimpleNamespace(remote=lambda: ranks), ws_meta=SimpleNamespace(remote=lambda: metas)
        )

    monkeypatch.setattr(vllm_servers, "HttpControl", lambda url: servers.setdefault(url, FakeServer(url)))
    monkeypatch.setattr(vllm_servers, "attach", attach)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    pods = [ServerPod(name=f"vllm-{i}", uid=f"uid-{i}", ip=f"10.0.0.{i + 1}", ready=True) for i in range(2)]
    attacher = vllm_servers.ServerAttacher("team-a", "policy", list_pods=lambda ns, labels: pods)
    attacher(servers_spec({"replicas": 4}, 2).destinations[0])
    assert attached == [("http://10.0.0.1:8000", 0, 2), ("http://10.0.0.2:8000", 2, 2)]
    servers.clear()
    servers["http://10.0.0.1:8000"] = FakeServer("http://10.0.0.1:8000", world=1, dp=1)
    with pytest.raises(TopologyMismatchError, match="vllm-0 runs 1 data-parallel engine"):
        vllm_servers.ServerAttacher("team-a", "policy", list_pods=lambda ns, labels: pods)(
            servers_spec({"replicas": 4}, 2).destinations[0]
        )


def test_a_batch_dispatches_at_once_only_with_every_rank_of_the_engine() -> None:
    # A DP server's replicas are called together (runtime/commit.engines_of): half of them is not
    # a whole batch, and a resume waits longer for the rest than other methods do
    batcher = RankBatcher()
    batcher._init_batcher(4)
    assert not batcher._complete(Batch("ws_commit", args={0: (), 1: ()}))
    assert batcher._complete(Batch("ws_commit", args={i: () for i in range(4)}))
    assert gather_seconds("ws_resume") > gather_seconds("ws_commit")
    assert gather_seconds("ws_join") > gather_seconds("ws_resume")


def test_the_commit_phase_commits_a_servers_dp_replicas_together() -> None:
    def dest(rank: int, replica: int, handle: Any) -> Dest:
        meta = SimpleNamespace(coord=SimpleNamespace(replica=replica))
        return Dest(rank, SimpleNamespace(handle=handle, meta=meta), "rollout")  # type: ignore[arg-type]

    server, other = object(), object()  # two proxies: a DP 2 x TP 2 server, a TP 2 engine
    dests = [dest(r, 4 + (r - 2) // 2, RankHandle(server, r - 2)) for r in range(2, 6)]
    dests += [dest(r, 6, RankHandle(other, r - 6)) for r in (6, 7)]
    dests += [dest(r, 7 + r - 8, object()) for r in (8, 9)]  # one-rank replicas, an actor each
    groups = [[[d.rank for d in replica] for replica in group] for group in engines_of(dests)]
    assert groups == [[[2, 3], [4, 5]], [[6, 7]], [[8]], [[9]]]


def test_a_replica_held_paused_by_its_server_says_so() -> None:
    # DP replica 0 holds v2 on every rank but its server stays paused for replica 1 (on v1)
    held = ReplicaVersion(
        deployment="rollout", replica=0, version=None, state=ReplicaState.DEGRADED,
        reason="MixedVersions", rank_versions=["v2"],
    )  # fmt: skip
    mixed = held.model_copy(update={"replica": 1, "rank_versions": ["v1", None]})
    failure = replica_failure([held, mixed])
    assert failure is not None
    assert failure.message.endswith(
        "rollout replica 0: ranks on ['v2'], but their engine did not resume, "
        "rollout replica 1: ranks on ['v1', None]"
    ), failure.message


def test_a_failed_transfers_stuck_ranks_keep_their_replica_reported_and_out_of_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A DP server whose remote node died mid-transfer: the head's calls for its DP ranks wait on
    # the dead engine, so the coordinator does not ask those ranks (their calls would queue
    # behind the stuck ws_run). Their replicas are still reported, out of serving, and a replica
    # with one stuck rank is not judged (or resumed) by its other ranks' answers.
    asked: list[tuple[str, str]] = []

    def call_each(calls: list[tuple[Any, str, tuple]], timeout_s: float) -> list[Any]:
        asked.extend((p.name, m) for p, m, _ in calls)
        return [
            SimpleNamespace(version="v1", poisoned=False) if m == "ws_txn_state" else True
            for _, m, _ in calls
        ]

    def dest(rank: int, replica: int) -> Dest:
        meta = SimpleNamespace(coord=SimpleNamespace(replica=replica))
        return Dest(rank, SimpleNamespace(handle=object(), name=f"r{rank}", meta=meta), "rollout")  # type: ignore[arg-type]

    monkeypatch.setattr(commit, "call_each", call_each)
    dests = [dest(2, 0), dest(3, 0), dest(4, 1), dest(5, 2)]
    replicas = commit.settle(dests, 10.0, unanswered=frozenset({3, 5}))
    assert asked == [("r2", "ws_txn_state"), ("r4", "ws_txn_state"), ("r4", "ws_resume")]
    got = [(r.replica, r.state, r.version, r.rank_versions) for r in replicas]
    assert got == [
        (0, ReplicaState.DEGRADED, None, ["v1", None]),
        (1, ReplicaState.SERVING, "v1", ["v1"]),
        (2, ReplicaState.DEGRADED, None, [None]),
    ]
    # control: asked, the same ranks make every replica serve
    asked.clear()
    assert all(r.state is ReplicaState.SERVING for r in commit.settle(dests, 10.0))
