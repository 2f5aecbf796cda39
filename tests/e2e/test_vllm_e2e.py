"""A WeightSync applied with kubectl whose destination is a real vLLM engine (engine env only).

Everything of tests/e2e/test_weightsync_e2e.py is real here too (kube-apiserver and controllers,
helm, the chart, `kopf run`, the runtime pod's `weightsync run --kubernetes`, Ray with token
auth), and the destination is one `VllmReplica` (vLLM 0.32 CPU, TP 1, dummy weights), a
detached named actor found by its prefix. Sources: the demo's Megatron-layout actors (tp=2)
holding shards of the seeded canonical weights of Qwen3 (tied embeddings). Oracle: the same
vLLM loaded normally from a checkpoint of those canonical weights, one engine per version, started
only when the reference cache lacks its outputs (sync_runtime/testing/reference_cache.py);
generation is greedy, compared as token ids and logprobs, bit for bit.

Runs in `make test-engines` (vllm, Ray and this project in the engine env; `make test`'s
project venv has no vLLM and ignores this file). The Ray side runs in subprocess drivers
(tests/e2e/vllm_driver.py): the pytest process already drives the engine tests' own cluster.
The tests share one release and one WeightSync and run in file order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
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

from sync_runtime.core.models import build_manifest
from sync_runtime.testing import reference_cache
from tests.support.vllm_deploy import CONFIGS, rows_equal, write_model
from tests.support.vllm_oracle import oracle_key

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

CHART = Path(__file__).resolve().parents[2] / "charts" / "weightsync-operator"
DRIVER = str(Path(__file__).resolve().parent / "vllm_driver.py")
NS = "ws-vllm"
RELEASE = "wso-vllm"
WS = "policy"
SECRET = "ray-token"
RAY_NS = "e2e-vllm"
DST_PREFIX = "vllm-"
ENGINE = f"{DST_PREFIX}r0"
SEED = 7
SYNC_TIMEOUT = 240
"""Seconds for a sync through a fresh runtime pod on a loaded 2-core machine (imports torch, joins Ray)."""


@dataclass
class Stack:
    """The running deployment: what the oracle generated, the phase timings, the driver."""

    cluster: RayCluster
    config_path: str
    dummy: list[dict[str, list]]
    reference: dict[str, list[dict[str, list]]]
    initial_label: str
    seconds: dict[str, float] = field(default_factory=dict)

    def driver(self, cmd: str, *args: str) -> Any:
        out = self.cluster.run(
            sys.executable, DRIVER, cmd, "--address", self.cluster.address, "--namespace", RAY_NS, *args
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def generate(self) -> tuple[list[dict[str, list]], str]:
        got = self.driver("generate", "--name", ENGINE)
        return got["rows"], got["version"]

    def train(self, version: str) -> None:
        self.driver("train", "--config", self.config_path, "--seed", str(SEED), "--version", version)

    def timed(self, phase: str, t0: float) -> None:
        self.seconds[phase] = round(time.monotonic() - t0, 1)


def _manifest(address: str, version: str) -> dict[str, Any]:
    """No spec.model: the runtime reads the model config from the source actors."""

    def ref(name: str, prefix: str, layout: str, parallelism: dict[str, int]) -> dict[str, Any]:
        return {
            "name": name,
            "rayAddress": address,
            "rayNamespace": RAY_NS,
            "actorPrefix": prefix,
            "layout": layout,
            "parallelism": parallelism,
            "authSecretRef": {"name": SECRET, "key": "auth_token"},
        }

    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": WS, "namespace": NS},
        "spec": {
            "version": version,
            "source": ref("trainer", "trainer-", "megatron", {"tp": 2}),
            "destinations": [ref("rollout", DST_PREFIX, "vllm", {"tp": 1, "replicas": 1})],
            "transport": {
                "bucketMb": 1,
                "stagingBudgetMb": 8,
                "connectTimeoutSeconds": 60,
                "transferTimeoutSeconds": 60,
            },
            "retry": {"limit": 2, "backoffSeconds": 1, "maxBackoffSeconds": 5},
        },
    }


def _up(ray_cluster: RayCluster, work: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Checkpoints of v1 and v2, then the driver that starts sources and engines (in the
    background); an oracle engine only for a version whose outputs the reference cache lacks.
    Returns the driver and, per version, the oracle's cache key and cached outputs (or None)."""
    config = CONFIGS["qwen3"]
    manifest = build_manifest(config)
    dirs = {v: write_model(work / v, config, manifest, seed=SEED, version=v) for v in ("v1", "v2")}
    args = ["up", "--config", f"{dirs['v1']}/config.json", "--seed", str(SEED), "--version", "v1"]
    oracles = {}
    for version, directory in dirs.items():
        key = oracle_key(directory, {"tp": 1}, calls=1)  # the driver's oracles: TP 1, one call
        oracles[version] = (key, reference_cache.load(key)[0])
        if oracles[version][1] is None:
            args += ["--reference", f"{version}={directory}"]
    return subprocess.Popen(
        [sys.executable, DRIVER, *args, "--address", ray_cluster.address, "--namespace", RAY_NS],
        env=ray_cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ), oracles


def _references(oracles: dict[str, Any], computed: dict[str, Any]) -> dict[str, list[dict[str, list]]]:
    """Each version's oracle generation: cached, or computed by the driver now (and cached)."""
    out = {}
    for version, (key, cached) in oracles.items():
        if cached is None:
            cached = reference_cache.put(key, computed[version])
        out[version] = cached["calls"][0]
    return out


def _down(ray_cluster: RayCluster) -> None:
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
    """Engines and sources start while helm installs the operator; everything is removed after."""
    work = tmp_path_factory.mktemp("vllm-e2e")
    t0 = time.monotonic()
    up, oracles = _up(ray_cluster, work)
    installed = False
    failed_before = request.session.testsfailed
    stack: Stack | None = None
    try:
        kubectl("create", "namespace", NS)
        wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", NS), 30)
        kubectl(
            "create", "secret", "generic", SECRET, "-n", NS, f"--from-literal=auth_token={ray_cluster.token}"
        )
        (work / "values.yaml").write_text(yaml.safe_dump(operator_values(NS, free_port())))
        t_helm = time.monotonic()
        helm(
            "install",
            RELEASE,
            str(CHART),
            "-n",
            NS,
            "-f",
            str(work / "values.yaml"),
            "--wait",
            "--timeout",
            "3m",
            timeout=240,
        )
        installed = True
        helm_s = round(time.monotonic() - t_helm, 1)
        stdout, stderr = up.communicate(timeout=600)
        assert up.returncode == 0, f"vllm_driver up exited {up.returncode}:\n{stderr[-4000:]}"
        got = json.loads(stdout.strip().splitlines()[-1])
        refs = _references(oracles, got["reference"])
        stack = Stack(ray_cluster, f"{work / 'v1'}/config.json", got["dummy"], refs, got["version"])
        stack.seconds["helm install (concurrent)"] = helm_s
        stack.seconds.update({f"up: {k}": round(v, 1) for k, v in got["seconds"].items()})
        stack.timed("setup", t0)
        yield stack
    finally:
        t_down = time.monotonic()
        if up.poll() is None:
            up.kill()
            up.communicate()
        if request.session.testsfailed > failed_before:
            dump_pod_logs(node_agent.workdir / "pods", NS)
        # The WeightSync first, while its operator runs (kopf's finalizer), then the release.
        kubectl(
            "delete",
            "weightsync",
            WS,
            "-n",
            NS,
            "--ignore-not-found",
            "--timeout=60s",
            check=False,
            timeout=90,
        )
        if installed:
            helm("uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=120)
        kubectl("delete", "namespace", NS, "--wait=false", check=False)
        _down(ray_cluster)
        if stack is not None:
            stack.timed("teardown", t_down)
            say(request.config, f"vllm e2e phases (s): {json.dumps(stack.seconds)}")


def _wait_synced(kubectl: Any, version: str) -> dict[str, Any]:
    kubectl(
        "wait",
        f"weightsync/{WS}",
        "-n",
        NS,
        f"--for=jsonpath={{.status.syncedVersion}}={version}",
        f"--timeout={SYNC_TIMEOUT}s",
        timeout=SYNC_TIMEOUT + 30,
    )
    kubectl("wait", f"weightsync/{WS}", "-n", NS, "--for=condition=Synced", "--timeout=60s", timeout=90)
    obj = get_json(kubectl, "weightsync", WS, "-n", NS)
    assert obj is not None and obj["status"]["phase"] == "Synced", obj
    last = obj["status"]["lastSync"]
    assert last["version"] == version and last["result"] == "Succeeded", last
    assert last["movedBytes"] > 0, last
    return obj  # type: ignore[no-any-return]


def test_the_oracle_tells_the_versions_apart(stack: Stack) -> None:
    """Negative controls: the dummy engine and the two versions generate differently."""
    ref = stack.reference
    assert len(ref["v1"]) == len(ref["v2"]) == len(stack.dummy) == 4
    assert rows_equal(stack.dummy, ref["v1"]) == 0 and rows_equal(stack.dummy, ref["v2"]) == 0
    assert rows_equal(ref["v1"], ref["v2"]) == 0
    assert stack.initial_label != "v1"


def test_kubectl_apply_syncs_the_vllm_engine_bit_for_bit(
    stack: Stack, ray_cluster: RayCluster, kubectl: Any, tmp_path: Path
) -> None:
    """kubectl apply -> Synced; the engine generates exactly like vLLM loaded from the v1 checkpoint."""
    path = tmp_path / "weightsync.yaml"
    path.write_text(yaml.safe_dump(_manifest(ray_cluster.address, "v1")))
    t0 = time.monotonic()
    kubectl("apply", "-f", str(path))
    obj = _wait_synced(kubectl, "v1")
    stack.timed("apply -> Synced v1 (runtime pod start included)", t0)
    assert condition(obj, "RuntimeReady")["status"] == "True"  # type: ignore[index]
    assert condition(obj, "Degraded")["status"] == "False"  # type: ignore[index]
    pods = [p for p in runtime_pods(kubectl, NS, WS) if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    argv = container_argv(pods[0])
    i = argv.index("run")
    # The runtime is the engine env's console script (PATH of the node agent): its Ray client is
    # the version the vLLM actors run.
    assert argv[i - 1] == str(Path(sys.executable).parent / "weightsync"), argv
    assert argv[i:] == ["run", "--kubernetes", "--namespace", NS, "--name", WS], argv

    t0 = time.monotonic()
    rows, label = stack.generate()
    stack.timed("generate v1", t0)
    assert label == obj["spec"]["version"] == "v1"  # the engine's weight version label
    assert rows == stack.reference["v1"]  # token ids and every logprob, bit for bit


def test_kubectl_patch_after_a_training_step_syncs_v2(stack: Stack, kubectl: Any) -> None:
    """Sources train a step, kubectl patch spec.version -> the same runtime pod syncs v2."""
    pod_uid = [p["metadata"]["uid"] for p in runtime_pods(kubectl, NS, WS)]
    t0 = time.monotonic()
    stack.train("v2")
    kubectl(
        "patch", "weightsync", WS, "-n", NS, "--type=merge", "-p", json.dumps({"spec": {"version": "v2"}})
    )
    obj = _wait_synced(kubectl, "v2")
    stack.timed("train + patch -> Synced v2", t0)
    assert obj["status"]["lastSync"]["planCached"] is True, obj["status"]["lastSync"]
    assert [p["metadata"]["uid"] for p in runtime_pods(kubectl, NS, WS)] == pod_uid, "runtime pod replaced"
    rows, label = stack.generate()
    assert label == "v2"
    assert rows == stack.reference["v2"]
