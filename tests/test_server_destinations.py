"""vllmServers destinations: the CRD fields, resolving server pods into replicas, pause seconds.

The pure parts: which pods serve and in what order, the refusals (replica count, world size)
before anything is attached, the spec the runtime discovers with, and the pause seconds carried
from the report into the CR's status. The real servers are in tests/engines/test_vllm_server*.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from weightsync_operator.replicas import replica_statuses

from sync_runtime.engines import vllm_servers
from sync_runtime.engines.vllm_servers import ServerAttacher, proxy_prefix
from sync_runtime.errors import DiscoveryError, Reason
from sync_runtime.kube.pods import (
    ServerPod,
    check_servers,
    endpoints,
    label_selector,
    replica_count_problem,
    server_url,
    world_size_problem,
)
from sync_runtime.kube.status import report_json
from sync_runtime.runtime import servers
from sync_runtime.runtime.commit import Dest, replica_pause_seconds
from sync_runtime.schema import crd
from sync_runtime.schema.crd import WeightSyncSpec, spec_problems
from sync_runtime.schema.report import ReplicaState, ReplicaVersion, SyncReport, SyncResult
from tests.support.specs import spec_with_destination

pytestmark = pytest.mark.unit

SERVERS = {"selector": {"matchLabels": {"app": "vllm", "model": "qwen"}}, "port": 8000}


def spec(**dest: Any) -> WeightSyncSpec:
    destination = {"name": "rollout", "layout": "vllm", "vllmServers": SERVERS, **dest}
    return spec_with_destination({k: v for k, v in destination.items() if v is not None})


def pod(name: str, ready: bool = True, ip: str | None = "10.1.0.5", deleting: bool = False) -> ServerPod:
    return ServerPod(name=name, uid=f"uid-{name}", ip=ip, ready=ready, deleting=deleting)


# ---- the CRD fields -----------------------------------------------------------------------


def test_a_servers_destination_is_valid_without_ray_fields_or_auth() -> None:
    s = spec(parallelism={"tp": 2, "replicas": 3}, pause="wait")
    dest = s.destinations[0]
    assert dest.vllm_servers is not None and dest.vllm_servers.port == 8000
    assert dest.vllm_servers.selector.match_labels == {"app": "vllm", "model": "qwen"}
    assert (dest.actor_prefix, dest.ray_address, dest.pause_mode) == (None, None, "wait")
    assert spec_problems(s) == []  # no authSecretRef needed: it joins the source's Ray cluster
    assert crd.ray_deployments(s) == [s.source]
    assert spec().destinations[0].pause_mode == "keep"  # the default


@pytest.mark.parametrize(
    ("dest", "message"),
    [
        ({"actorPrefix": "vllm-"}, crd.MSG_DEST_TARGET),
        ({"vllmServers": None}, crd.MSG_DEST_TARGET),
        ({"rayAddress": "10.0.0.1:6379"}, crd.MSG_SERVERS_NO_RAY),
        ({"rayCluster": "rl"}, crd.MSG_SERVERS_NO_RAY),
        ({"layout": "hf"}, crd.MSG_SERVERS_LAYOUT),
        (
            {"vllmServers": None, "actorPrefix": "v-", "rayAddress": "10.0.0.1:6379", "pause": "abort"},
            crd.MSG_PAUSE_SERVERS,
        ),
    ],
)
def test_bad_servers_destinations_name_their_rule(dest: dict, message: str) -> None:
    s = spec(**dest)
    assert f"spec.destinations[0]: {message}" in spec_problems(s)


def test_source_cannot_name_servers_or_omit_its_prefix() -> None:
    raw = spec().model_dump(by_alias=True, exclude_none=True)
    raw["source"]["vllmServers"] = SERVERS
    del raw["source"]["actorPrefix"]
    problems = spec_problems(WeightSyncSpec.model_validate(raw))
    assert f"spec.source: {crd.MSG_SOURCE_SERVERS}" in problems
    assert f"spec.source: {crd.MSG_SOURCE_PREFIX}" in problems


def test_pause_mode_and_selector_are_checked_by_the_model() -> None:
    with pytest.raises(ValueError, match="pause"):
        spec(pause="drain")
    with pytest.raises(ValueError, match=r"matchLabels|match_labels"):
        spec(vllmServers={"selector": {"matchLabels": {}}})
    with pytest.raises(ValueError, match="port"):
        spec(vllmServers={**SERVERS, "port": 70000})


# ---- pods -> replicas ---------------------------------------------------------------------


def test_only_serving_pods_count_and_they_are_ordered_by_name() -> None:
    pods = [
        pod("vllm-2"),
        pod("vllm-0", ip="10.1.0.7"),
        pod("vllm-3", ready=False),
        pod("vllm-4", ip=None),
        pod("vllm-5", deleting=True),
        pod("vllm-1", ip="fd00::9"),
    ]
    eps = endpoints(pods, 8000)
    assert [(e.replica, e.pod) for e in eps] == [(0, "vllm-0"), (1, "vllm-1"), (2, "vllm-2")]
    assert eps[0].url == "http://10.1.0.7:8000" and eps[1].url == "http://[fd00::9]:8000"
    assert server_url("10.0.0.1", 1) == "http://10.0.0.1:1"
    assert label_selector({"model": "qwen", "app": "vllm"}) == "app=vllm,model=qwen"


def test_a_restarted_server_is_another_instance_of_its_replica() -> None:
    first = endpoints([pod("vllm-0")], 8000)[0]
    again = endpoints([ServerPod("vllm-0", "uid-vllm-0", "10.1.0.5", True, restarts=1)], 8000)[0]
    assert (first.restarts, again.restarts) == (0, 1)
    assert first.instance != again.instance and first.url == again.url  # a new proxy, same server URL


def test_a_replica_count_mismatch_is_refused_naming_the_pods_not_serving() -> None:
    pods = [pod("vllm-b"), pod("vllm-a", ready=False)]
    assert replica_count_problem("rollout", "app=vllm", pods[:1], 1) is None
    with pytest.raises(DiscoveryError) as e:
        check_servers("rollout", "app=vllm", pods, 2, 8000)
    assert e.value.message == (
        "deployment 'rollout': 1 Ready vLLM server pod(s) match 'app=vllm', expected replicas=2; "
        "not serving: vllm-a"
    )
    # retryable: pods of a rollout or a restarted server become Ready again
    assert e.value.reason is Reason.DISCOVERY_FAILED and e.value.to_failure().retryable
    assert "\n" not in e.value.message


def test_world_size_must_be_the_declared_tp_times_pp() -> None:
    assert world_size_problem("rollout", "vllm-0", 4, 2, 2) is None
    assert world_size_problem("rollout", "vllm-0", 2, 1, 1) == (
        "deployment 'rollout': vLLM server pod vllm-0 runs 2 worker(s), "
        "the declared parallelism needs tp*pp = 1*1 = 1"
    )


def test_attacher_refuses_a_missing_replica_before_attaching_anything() -> None:
    listed: list[tuple[str, dict]] = []

    def list_pods(namespace: str, labels: Any) -> list[ServerPod]:
        listed.append((namespace, dict(labels)))
        return [pod("vllm-0", ready=False)]

    attacher = ServerAttacher("team-a", "policy", list_pods=list_pods)
    with pytest.raises(DiscoveryError, match="0 Ready vLLM server pod"):
        attacher(spec().destinations[0])
    assert listed == [("team-a", {"app": "vllm", "model": "qwen"})]
    assert not attacher._proxies.get("rollout")  # nothing attached


def test_the_attacher_starts_every_new_proxy_before_waiting_for_any(monkeypatch: pytest.MonkeyPatch) -> None:
    # a proxy's start is a Ray worker importing torch, then init_weight_transfer_engine on the
    # server's workers: N new pods must cost one start, not N in a row
    events: list[tuple[str, str]] = []
    killed: list[str] = []

    class Server:
        def __init__(self, url: str) -> None:
            self.url = url

        def world_size(self) -> int:
            return 1

        def data_parallel_size(self) -> int:
            return 1

    def attach(name: str, namespace: str, control: Any, *, replica: int, pause: str, ranks: int) -> Any:
        events.append(("start", control.url))
        metas = [SimpleNamespace(coord=SimpleNamespace(replica=replica))]

        def meta() -> list[Any]:
            events.append(("wait", control.url))
            if control.url.startswith("http://10.0.0.2:"):
                raise ray.exceptions.GetTimeoutError("no answer")
            return metas

        return SimpleNamespace(ws_meta=SimpleNamespace(remote=lambda: meta))

    monkeypatch.setattr(vllm_servers, "HttpControl", Server)
    monkeypatch.setattr(vllm_servers, "attach", attach)
    monkeypatch.setattr(vllm_servers, "_kill", lambda entry: killed.append(entry[0]))
    monkeypatch.setattr(vllm_servers.ray, "get", lambda call, timeout=None: call())
    pods = [pod(f"vllm-{i}", ip=f"10.0.0.{i + 1}") for i in range(3)]
    attacher = ServerAttacher("team-a", "policy", list_pods=lambda ns, labels: pods)
    with pytest.raises(DiscoveryError, match=r"vllm-1 .* the weightsync backend did not start"):
        attacher(spec(parallelism={"replicas": 3}).destinations[0])
    urls = [f"http://10.0.0.{i + 1}:8000" for i in range(3)]
    assert events == [("start", u) for u in urls] + [("wait", u) for u in urls]
    assert len(killed) == 1 and ".vllm-1." in killed[0]  # the failed pod's proxy only
    assert sorted(r for _, _, r in attacher._proxies["rollout"]) == [0, 2]  # kept for the next sync


def test_proxy_prefixes_never_nest() -> None:
    a, b = proxy_prefix("ws", "rollout"), proxy_prefix("ws", "rollout-2")
    assert not b.startswith(a) and not a.startswith(b)


# ---- the spec the runtime discovers with ----------------------------------------------------


def test_discovery_spec_gets_the_attached_prefix_and_needs_an_attacher() -> None:
    s = spec()
    servers.install(None)
    with pytest.raises(DiscoveryError, match="needs the server attacher"):
        servers.with_server_actors(s)
    seen: list[str] = []
    servers.install(lambda ref: seen.append(ref.name) or proxy_prefix("ws", ref.name))
    try:
        found = servers.with_server_actors(s)
    finally:
        servers.install(None)
    assert seen == ["rollout"]
    assert found.destinations[0].actor_prefix == "wsservers.ws.rollout."
    assert s.destinations[0].actor_prefix is None  # the CR's spec is left as it is
    plain = WeightSyncSpec.model_validate(
        {
            **s.model_dump(by_alias=True, exclude_none=True),
            "destinations": [s.source.model_dump(by_alias=True)],
        }
    )
    assert servers.with_server_actors(plain) is plain  # no servers: no attacher needed


# ---- pause seconds: report -> status ------------------------------------------------------


def test_pause_seconds_reach_the_status_per_replica() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    replicas = [
        ReplicaVersion(
            deployment="rollout", replica=0, version="v1", state=ReplicaState.SERVING, pause_seconds=0.31
        ),
        ReplicaVersion(
            deployment="rollout", replica=1, state=ReplicaState.DEGRADED, rank_versions=["v1", None]
        ),
    ]
    report = SyncReport(
        version="v1", started_at=now, finished_at=now, result=SyncResult.SUCCEEDED, replicas=replicas
    )
    stored = report_json(report)
    assert [r.get("pauseSeconds") for r in stored["replicas"]] == [0.31, None]
    status = replica_statuses(SyncReport.model_validate(stored), [])
    assert [r.pause_seconds for r in status] == [0.31, None]
    dumped = status[0].model_dump(by_alias=True)
    assert dumped["pauseSeconds"] == 0.31 and "rankTable" not in dumped


class _NoPause:
    """A destination rank handle without an engine proxy behind it (a plain actor)."""


def test_replicas_without_a_measured_pause_report_none() -> None:
    from sync_runtime.runtime.discovery import Participant

    participant = Participant(handle=_NoPause(), name="x", namespace="n", meta=None)  # type: ignore[arg-type]
    assert replica_pause_seconds([Dest(rank=1, p=participant, deployment="d")], 1.0) is None


def test_the_example_is_a_valid_servers_destination_for_its_deployment() -> None:
    import yaml
    from bad_manifests.offline import apply_defaults, schema_errors

    root = Path(__file__).resolve().parents[1]
    deployment, ws = yaml.safe_load_all((root / "examples" / "vllm-servers.yaml").read_text())
    crd_doc = yaml.safe_load((root / "crds" / "weightsyncs.weightsync.io.yaml").read_text())
    schema = crd_doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema_errors(schema, ws) == []
    s = WeightSyncSpec.model_validate(apply_defaults(schema, ws)["spec"])
    assert spec_problems(s) == []
    (dest,) = s.destinations
    assert dest.vllm_servers is not None
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"] == dest.vllm_servers.selector.match_labels
    assert deployment["spec"]["replicas"] == dest.parallelism.replicas
    (container,) = pod["spec"]["containers"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]
    assert '--weight-transfer-config={"backend": "weightsync"}' in container["args"]
    assert f"--port={dest.vllm_servers.port}" in container["args"]
    assert f"--tensor-parallel-size={dest.parallelism.tp}" in container["args"]


def test_the_unauthenticated_ray_warning_names_only_ray_deployments() -> None:
    from weightsync_operator.reconcile import unauthenticated_ray_event

    raw = spec().model_dump(by_alias=True, exclude_none=True)
    raw["allowUnauthenticatedRay"] = True
    del raw["source"]["authSecretRef"]
    (event,) = unauthenticated_ray_event(WeightSyncSpec.model_validate(raw), 3)
    assert event.message == "allowUnauthenticatedRay: trainer connect(s) without a Ray token"


def test_weightsync_run_installs_the_server_attacher_for_its_weightsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`weightsync run` (the runtime pod's command) is what attaches vllmServers destinations."""
    import yaml

    from sync_runtime.cli import main as cli

    root = Path(__file__).resolve().parents[1]
    _, ws = yaml.safe_load_all((root / "examples" / "vllm-servers.yaml").read_text())
    ws["spec"]["model"] = "tiny-llama"  # the CLI plans a manifest naming its model before running it
    ws["spec"]["source"]["parallelism"] = {"tp": 2}
    path = tmp_path / "ws.yaml"
    path.write_text(yaml.safe_dump(ws))
    module = cli._load(cli.DELEGATES["run"])
    ran: list[Any] = []
    monkeypatch.setattr(module, "run", lambda args: ran.append(args) or 0)
    servers.install(None)
    try:
        assert cli.main(["run", "--config", str(path), "--namespace", "team-a", "--name", "policy"]) == 0
        attacher = servers._attacher
    finally:
        servers.install(None)
    assert len(ran) == 1 and isinstance(attacher, ServerAttacher)
    assert (attacher.namespace, attacher.weightsync) == ("team-a", "policy")
