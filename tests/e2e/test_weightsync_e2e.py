"""WeightSync end to end: Helm-installed operator, a token-authenticated Ray cluster, real syncs.

Everything above the node agent is real: kube-apiserver and controllers, kubectl and helm, the
chart, the `kopf run -m weightsync_operator` process, the runtime pod's `weightsync run
--kubernetes` process, Ray (token auth on) and the torch.distributed transfers between the demo's
participant actors. The tests of this module share one operator release and one WeightSync and
run in file order; each one leaves the WeightSync Synced at a known version for the next.

Versions: the sources "train a step" (`weightsync demo --train-step V`) before spec.version is
set to V; destinations are checked bit-exact against the seeded weights of V
(`weightsync demo --verify-only --expect-version V`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import free_port
from helpers import condition, events_for, get_json, runtime_pods, wait_for
from ray_cluster import RayCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bad_manifests.cases import BadManifest, load_cases

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weightsync-operator"
EXAMPLE = REPO / "examples" / "weightsync.yaml"
NS = "ws-e2e"
BAD_NS = "ws-e2e-bad"
RELEASE = "wso"
WS = "policy"
SECRET = "ray-token"
MODEL = "tiny-llama"
SRC, DST = "tp=2", "tp=2,replicas=2"
DST_RANKS = 4
RAY_NS = "e2e-policy"
SRC_PREFIX, DST_PREFIX = "trainer-", "vllm-"
SEED = 11
SYNC_TIMEOUT = 240
"""Seconds for a sync through a fresh runtime pod on a loaded 2-core machine (imports torch, joins Ray)."""


# ---- the Ray side: participants of the demo -----------------------------------------------------


@dataclass
class Deployment:
    """The demo's participants in the e2e Ray cluster, driven through the `weightsync demo` CLI."""

    cluster: RayCluster
    gate_file: Path
    gated: bool = False

    def demo(self, *args: str, check: bool = True) -> Any:
        return self.cluster.run(
            "weightsync",
            "demo",
            *args,
            "--ray-address",
            self.cluster.address,
            "--namespace",
            RAY_NS,
            "--model",
            MODEL,
            "--src",
            SRC,
            "--dst",
            DST,
            "--src-prefix",
            SRC_PREFIX,
            "--dst-prefix",
            DST_PREFIX,
            "--seed",
            str(SEED),
            check=check,
        )

    def setup_args(self) -> list[str]:
        return [
            "--namespace", RAY_NS, "--model", MODEL, "--src", SRC, "--dst", DST, "--seed", str(SEED),
            "--src-prefix", SRC_PREFIX, "--dst-prefix", DST_PREFIX,
        ]  # fmt: skip

    def train_step(self, version: str, *, cli: bool = False) -> None:
        """Sources regenerate `version`: through the suite's driver, or `weightsync demo --train-step`
        (the same function behind the CLI, which one test keeps running)."""
        if cli:
            self.demo("--train-step", version)
        else:
            self.cluster.driver("train-step", *self.setup_args(), "--version", version)

    def verify(self, version: str) -> None:
        problems = self.cluster.driver("verify", *self.setup_args(), "--version", version)["problems"]
        assert problems == [], f"destinations do not hold {version} bit-exact: {problems}"

    def snapshot_args(self) -> list[str]:
        return [
            "snapshot",
            "--namespace",
            RAY_NS,
            "--prefix",
            DST_PREFIX,
            "--model",
            MODEL,
            "--dst",
            DST,
            "--seed",
            str(SEED),
        ]

    def snapshot(self) -> dict[str, Any]:
        """Per destination rank: the version it reports and whether its bits are exactly that version's."""
        return self.cluster.driver(*self.snapshot_args())["ranks"]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def gate(self) -> Iterator[None]:
        """Destination ranks wait before every transfer round while the gate is closed."""
        if not self.gated:
            self.cluster.driver(
                "gate", "--namespace", RAY_NS, "--prefix", DST_PREFIX, "--gate-file", str(self.gate_file)
            )
            self.gated = True
        for marker in self.gate_file.parent.glob(f"{self.gate_file.name}.*.reached"):
            marker.unlink()
        self.gate_file.touch()
        try:
            yield
        finally:
            self.gate_file.unlink(missing_ok=True)

    def wait_at_gate(self, ranks: int = DST_RANKS, timeout: float = SYNC_TIMEOUT) -> None:
        """Until `ranks` destination ranks are inside a transfer, held at the closed gate."""

        def reached() -> bool:
            return len(list(self.gate_file.parent.glob(f"{self.gate_file.name}.*.reached"))) >= ranks

        wait_for(f"{ranks} destination ranks at the gate (mid-transfer)", reached, timeout)


@pytest.fixture(scope="module")
def deployment(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = Deployment(ray_cluster, tmp_path_factory.mktemp("gate") / "closed")
    t0 = time.monotonic()
    dep.demo("--participants-only", "--version", "v1", "--stale-version", "v0")
    print(f"participants ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    yield dep
    ray_cluster.driver("kill-all", "--namespace", RAY_NS)  # detached: they would outlive the module


# ---- the Kubernetes side -------------------------------------------------------------------------


@dataclass
class Release:
    values: dict[str, Any]
    values_path: Path
    state: dict[str, Any] = field(default_factory=dict)
    """What earlier tests learned (runtime pod uid, ...), for the later ones."""


def _values(metrics_port: int, extra_args: list[str] | None = None) -> dict[str, Any]:
    return {
        # Single-namespace mode: the operator watches NS only (a Role, no ClusterRole), so the
        # bad-manifest cases in BAD_NS keep the status the test sets.
        "watchNamespace": NS,
        "operator": {
            # The node agent puts the venv's bin first on PATH: `kopf` is the real kopf CLI.
            "command": ["kopf"],
            "extraArgs": extra_args or [],
            "healthPort": 0,  # no kubelet probes here
            "reconcileIntervalSeconds": 1,
        },
        "bindAddress": "127.0.0.1",  # nothing in the test listens off loopback
        "metrics": {"port": metrics_port},
    }


def _operator_pod(kubectl: Any) -> dict[str, Any] | None:
    pods = get_json(kubectl, "pods", "-n", NS, "-l", "app.kubernetes.io/name=weightsync-operator")
    live = [p for p in (pods or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]
    running = [p for p in live if p.get("status", {}).get("phase") == "Running"]
    return running[0] if running else None


def _cmdline(pod: dict[str, Any]) -> list[str]:
    """argv of the local process the node agent runs for the pod's first container."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    pid = int(cid.removeprefix("local://"))
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    # The agent runs `unshare ... sh -c SCRIPT sh EXE ARGS`: the container's argv follows "sh".
    argv = [a.decode() for a in raw.split(b"\0") if a]
    return argv


@pytest.fixture(scope="module")
def release(
    control_plane: Any,
    node_agent: Any,
    kubectl: Any,
    helm: Any,
    ray_cluster: RayCluster,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Release]:
    for ns in (NS, BAD_NS):
        kubectl("create", "namespace", ns)
    wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", NS), 30)
    kubectl("create", "secret", "generic", SECRET, "-n", NS, f"--from-literal=auth_token={ray_cluster.token}")
    values = _values(free_port())
    path = tmp_path_factory.mktemp("helm") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    t0 = time.monotonic()
    helm("install", RELEASE, str(CHART), "-n", NS, "-f", str(path), "--wait", "--timeout", "3m", timeout=240)
    print(f"helm install + operator Running in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    rel = Release(values, path)
    failed_before = request.session.testsfailed
    try:
        yield rel
    finally:
        if request.session.testsfailed > failed_before:
            _dump_pod_logs(node_agent.workdir / "pods")
        helm("uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=120)
        for ns in (NS, BAD_NS):
            kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _dump_pod_logs(pods_dir: Path, tail: int = 60) -> None:
    """On failure: the last lines of every pod the node agent ran in NS (operator, runtimes)."""
    for log in sorted(pods_dir.glob(f"{NS}_*/logs/*.log"), key=lambda p: p.stat().st_mtime):
        noise = ("Timer 'tick' succeeded", "Handler 'on_event' succeeded")
        lines = [x for x in log.read_text(errors="replace").splitlines() if not any(n in x for n in noise)]
        lines = lines[-tail:]
        print(f"----- {log.parent.parent.name}/{log.name} (last {len(lines)} lines)", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)


def _manifest(address: str, version: str) -> dict[str, Any]:
    """examples/weightsync.yaml, pointed at the local Ray cluster and the demo's participants."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert doc["kind"] == "WeightSync"
    doc["metadata"] = {"name": WS, "namespace": NS}
    spec = doc["spec"]
    spec["version"], spec["model"] = version, MODEL

    def point(ref: dict[str, Any], prefix: str, parallelism: dict[str, int]) -> dict[str, Any]:
        ref = copy.deepcopy(ref)
        ref.pop("rayCluster", None)
        ref.update(
            rayAddress=address,
            rayNamespace=RAY_NS,
            actorPrefix=prefix,
            parallelism=parallelism,
            authSecretRef={"name": SECRET, "key": "auth_token"},
        )
        return ref

    spec["source"] = point(spec["source"], SRC_PREFIX, {"tp": 2})
    spec["destinations"] = [point(spec["destinations"][0], DST_PREFIX, {"tp": 2, "replicas": 2})]
    spec["transport"].update(
        bucketMb=1, stagingBudgetMb=8, connectTimeoutSeconds=60, transferTimeoutSeconds=60
    )
    spec["retry"] = {"limit": 3, "backoffSeconds": 1, "maxBackoffSeconds": 5}
    spec.pop("runtime", None)  # the example's resource requests mean nothing to the node agent
    return doc


def _ws(kubectl: Any) -> dict[str, Any]:
    obj = get_json(kubectl, "weightsync", WS, "-n", NS)
    assert obj is not None, "WeightSync is gone"
    return obj  # type: ignore[no-any-return]


def _wait_synced(kubectl: Any, version: str, timeout: float = SYNC_TIMEOUT) -> dict[str, Any]:
    kubectl(
        "wait",
        f"weightsync/{WS}",
        "-n",
        NS,
        f"--for=jsonpath={{.status.syncedVersion}}={version}",
        f"--timeout={int(timeout)}s",
        timeout=timeout + 30,
    )
    kubectl("wait", f"weightsync/{WS}", "-n", NS, "--for=condition=Synced", "--timeout=60s", timeout=90)
    obj = _ws(kubectl)
    assert obj["status"]["phase"] == "Synced", obj["status"]
    assert obj["status"]["lastSync"]["version"] == version
    assert obj["status"]["lastSync"]["result"] == "Succeeded"
    return obj


def _set_version(kubectl: Any, version: str) -> None:
    kubectl(
        "patch", "weightsync", WS, "-n", NS, "--type=merge", "-p", json.dumps({"spec": {"version": version}})
    )


def _wait_syncing(kubectl: Any, version: str) -> None:
    """Until the CR says a sync of `version` runs (phase Syncing, the runtime's progress for it)."""

    def syncing() -> Any:
        status = _ws(kubectl).get("status") or {}
        rt = status.get("runtime") or {}
        return (
            status.get("phase") == "Syncing" and rt.get("phase") == "Syncing" and rt.get("version") == version
        )

    try:
        wait_for(f"phase Syncing for {version}", syncing, 30)
    except AssertionError as e:
        raise AssertionError(f"{e}; status: {json.dumps(_ws(kubectl).get('status'))[-3000:]}") from None


def _live_runtime_pods(kubectl: Any) -> list[dict[str, Any]]:
    return [p for p in runtime_pods(kubectl, NS, WS) if not p["metadata"].get("deletionTimestamp")]


# ---- tests ---------------------------------------------------------------------------------------


def test_helm_install_runs_the_real_operator(release: Release, kubectl: Any, helm: Any) -> None:
    """helm install: CRD from the chart's crds/, the operator Deployment's pod runs `kopf run`."""
    assert RELEASE in helm("list", "-n", NS, "-q").stdout.split()
    crd = get_json(kubectl, "crd", "weightsyncs.weightsync.io")
    assert crd is not None and crd["spec"]["names"]["shortNames"] == ["ws"]
    pod = wait_for("operator pod Running", lambda: _operator_pod(kubectl), 120)
    argv = _cmdline(pod)
    i = argv.index("run")
    assert Path(argv[i - 1]).name == "kopf" and argv[i : i + 3] == ["run", "-m", "weightsync_operator"], argv
    assert f"--namespace={NS}" in argv, argv
    release.state["operator_uid"] = pod["metadata"]["uid"]


def test_first_sync_through_kubectl(
    release: Release,
    deployment: Deployment,
    ray_cluster: RayCluster,
    kubectl: Any,
    node_agent: Any,
    tmp_path: Path,
) -> None:
    """kubectl apply of the example (templated) -> Synced, destinations bit-exact, printer columns."""
    path = tmp_path / "weightsync.yaml"
    path.write_text(yaml.safe_dump(_manifest(ray_cluster.address, "v1")))
    kubectl("apply", "-f", str(path))
    t0 = time.monotonic()
    kubectl(
        "wait",
        f"ws/{WS}",
        "-n",
        NS,
        "--for=condition=Synced",
        f"--timeout={SYNC_TIMEOUT}s",
        timeout=SYNC_TIMEOUT + 30,
    )
    print(f"first sync (runtime pod start included) in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    obj = _wait_synced(kubectl, "v1")
    deployment.verify("v1")

    status = obj["status"]
    last = status["lastSync"]
    assert last["movedBytes"] > 0 and last["plannedBytes"] > 0 and last["seconds"] > 0, last
    assert status["syncedVersion"] == "v1" and status["observedGeneration"] == obj["metadata"]["generation"]
    assert condition(obj, "RuntimeReady")["status"] == "True"  # type: ignore[index]
    assert condition(obj, "Degraded")["status"] == "False"  # type: ignore[index]

    table = kubectl("get", "ws", "-n", NS).stdout.splitlines()
    header = table[0].split()
    columns = ["NAME", "SOURCE", "DESTINATIONS", "DESIRED", "SYNCED", "PHASE", "SERVING", "DURATION", "AGE"]
    assert header == columns, table
    row = dict(zip(header, table[1].split(), strict=True))
    assert row["NAME"] == WS and row["SOURCE"] == "trainer" and "rollout-a" in row["DESTINATIONS"]
    assert row["DESIRED"] == row["SYNCED"] == "v1" and row["PHASE"] == "Synced", row
    assert row["SERVING"] == "2/2", row  # both replicas serve v1, named in status.replicas
    assert {(r["replica"], r["version"], r["state"]) for r in status["replicas"]} == {
        (0, "v1", "Serving"),
        (1, "v1", "Serving"),
    }, status
    assert float(row["DURATION"]) > 0, row

    pods = _live_runtime_pods(kubectl)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod = pods[0]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    argv = _cmdline(pod)
    i = argv.index("run")
    assert Path(argv[i - 1]).name == "weightsync", argv
    assert argv[i:] == ["run", "--kubernetes", "--namespace", NS, "--name", WS], argv
    release.state["runtime_uid"] = pod["metadata"]["uid"]
    release.state["runtime_name"] = pod["metadata"]["name"]

    # The Ray token reaches the runtime only through the Secret; it shows up nowhere else.
    token = ray_cluster.token
    assert token not in json.dumps(obj)
    assert token not in json.dumps(pod["spec"])
    assert token not in node_agent.logs(NS, pod["metadata"]["name"])
    assert token not in json.dumps(events_for(kubectl, NS, WS))


def test_version_bump_syncs_on_the_warm_runtime(
    release: Release, deployment: Deployment, kubectl: Any
) -> None:
    """kubectl patch spec.version -> a second sync on the same pod, plan cached, Events for both."""
    deployment.train_step("v2", cli=True)
    _set_version(kubectl, "v2")
    obj = _wait_synced(kubectl, "v2")
    deployment.verify("v2")
    last = obj["status"]["lastSync"]
    assert last["planCached"] is True, last
    assert last["movedBytes"] > 0
    pods = _live_runtime_pods(kubectl)
    assert [p["metadata"]["uid"] for p in pods] == [release.state["runtime_uid"]], "runtime pod was replaced"

    def both_synced() -> Any:
        evs = events_for(kubectl, NS, WS)
        seen = {(e["reason"], v) for e in evs for v in ("v1", "v2") if re.search(rf"\b{v}\b", e["message"])}
        want = {(r, v) for r in ("SyncStarted", "SyncSucceeded") for v in ("v1", "v2")}
        return evs if want <= seen else None

    evs = wait_for("SyncStarted/SyncSucceeded Events for v1 and v2", both_synced, 30)
    out = kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={WS}").stdout
    assert "SyncSucceeded" in out and "SyncStarted" in out, out
    assert all(e["type"] == "Normal" for e in evs if e["reason"].startswith("Sync")), evs


CASES = load_cases()
REFUSED = [c for c in CASES if c.stage in ("schema", "strict", "cel")]


def _in(manifest: dict[str, Any], namespace: str) -> str:
    doc = copy.deepcopy(manifest)
    doc["metadata"]["namespace"] = namespace
    return json.dumps(doc)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_bad_manifest_refused_by_api_server(release: Release, kubectl: Any, case: BadManifest) -> None:
    """`kubectl apply` of each bad manifest (tests/bad_manifests) fails with its exact message."""
    proc = kubectl("apply", "-f", "-", input=_in(case.manifest, BAD_NS), check=False)
    assert proc.returncode != 0, f"{case.name}: accepted: {proc.stdout}"
    for expected in case.expect:
        assert expected in proc.stderr, f"{case.name}: {expected!r} not in {proc.stderr!r}"
    assert get_json(kubectl, "weightsync", case.manifest["metadata"]["name"], "-n", BAD_NS) is None


@pytest.mark.parametrize("case", [c for c in CASES if c.stage == "transition"], ids=lambda c: c.name)
def test_bad_manifest_transition_refused(release: Release, kubectl: Any, case: BadManifest) -> None:
    """A CEL transition rule: valid alone, refused as an update while status.phase is Syncing.
    BAD_NS is not watched by the operator, so the status set here stays."""
    name = case.manifest["metadata"]["name"]
    kubectl("apply", "-f", "-", input=_in(case.base, BAD_NS))
    try:
        kubectl(
            "patch",
            "weightsync",
            name,
            "-n",
            BAD_NS,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": case.status or {}}),
        )
        proc = kubectl("apply", "-f", "-", input=_in(case.manifest, BAD_NS), check=False)
        assert proc.returncode != 0, f"{case.name}: update accepted"
        for expected in case.expect:
            assert expected in proc.stderr, f"{case.name}: {expected!r} not in {proc.stderr!r}"
        # The same change is fine once no sync is running.
        kubectl(
            "patch",
            "weightsync",
            name,
            "-n",
            BAD_NS,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": "Synced"}}),
        )
        kubectl("apply", "-f", "-", input=_in(case.manifest, BAD_NS))
    finally:
        kubectl("delete", "weightsync", name, "-n", BAD_NS, "--wait=false", check=False)


@pytest.mark.parametrize("case", [c for c in CASES if c.stage == "condition"], ids=lambda c: c.name)
def test_bad_manifest_reported_in_condition(release: Release, kubectl: Any, case: BadManifest) -> None:
    """What the schema cannot see is accepted, then reported by the operator as a condition."""
    name = case.manifest["metadata"]["name"]
    kubectl("apply", "-f", "-", input=_in(case.manifest, NS))
    want = case.expect_condition or {}
    try:

        def reported() -> Any:
            c = condition(get_json(kubectl, "weightsync", name, "-n", NS), want["type"])
            return c if c and all(c.get(k) == v for k, v in want.items() if k != "type") else None

        try:
            wait_for(f"{case.name}: condition {want}", reported, 150)
        except AssertionError:
            obj = get_json(kubectl, "weightsync", name, "-n", NS)
            raise AssertionError(
                f"{case.name}: want {want}; status: {json.dumps(obj.get('status'))}"
            ) from None
    finally:
        kubectl("delete", "weightsync", name, "-n", NS, "--wait=false", check=False)


def test_runtime_pod_deleted_mid_sync(release: Release, deployment: Deployment, kubectl: Any) -> None:
    """The runtime pod dies mid-transfer: its sync never commits (all ranks keep v2, checked while
    the replacement starts), the operator replaces the pod and the replacement syncs v3."""
    deployment.train_step("v3")
    old_uid = release.state["runtime_uid"]
    with deployment.gate():
        _set_version(kubectl, "v3")
        deployment.wait_at_gate()
        _wait_syncing(kubectl, "v3")
        # One call per destination, queued behind the gated transfer: it runs before anything
        # the replacement runtime asks of the ranks, so it sees what the dead runtime left.
        snap = deployment.cluster.driver_popen(*deployment.snapshot_args())
        assert snap.stdout is not None
        assert snap.stdout.readline().strip() == "submitted", snap.stderr.read() if snap.stderr else ""
        kubectl("delete", "pod", release.state["runtime_name"], "-n", NS, "--wait=false")

        def replaced() -> Any:
            pods = [p for p in _live_runtime_pods(kubectl) if p["metadata"]["uid"] != old_uid]
            return pods[0] if pods else None

        new_pod = wait_for("a replacement runtime pod", replaced, 90)
    out, err = snap.communicate(timeout=180)
    assert snap.returncode == 0, err
    ranks = json.loads(out.strip().splitlines()[-1])["ranks"]
    assert len(ranks) == DST_RANKS, ranks
    assert {r["version"] for r in ranks.values()} == {"v2"}, f"a mix of versions after the pod died: {ranks}"
    assert all(r["exact"] for r in ranks.values()), ranks

    _wait_synced(kubectl, "v3")
    deployment.verify("v3")
    pods = _live_runtime_pods(kubectl)
    assert [p["metadata"]["uid"] for p in pods] == [new_pod["metadata"]["uid"]]
    release.state["runtime_uid"] = new_pod["metadata"]["uid"]
    release.state["runtime_name"] = new_pod["metadata"]["name"]


def test_operator_killed_mid_sync(release: Release, deployment: Deployment, kubectl: Any) -> None:
    """The operator pod is deleted mid-sync; the Deployment's new operator picks up the running
    runtime pod (no duplicate), the sync completes and status catches up."""
    deployment.train_step("v4")
    old = _operator_pod(kubectl)
    assert old is not None
    with deployment.gate():
        _set_version(kubectl, "v4")
        deployment.wait_at_gate()
        _wait_syncing(kubectl, "v4")
        kubectl("delete", "pod", old["metadata"]["name"], "-n", NS, "--wait=false")

        def new_operator() -> Any:
            pod = _operator_pod(kubectl)
            return pod if pod and pod["metadata"]["uid"] != old["metadata"]["uid"] else None

        wait_for("a new operator pod Running", new_operator, 120)
        time.sleep(3)  # the new operator reconciles while the sync is still held at the gate
        pods = _live_runtime_pods(kubectl)
        assert [p["metadata"]["uid"] for p in pods] == [release.state["runtime_uid"]], pods
    _wait_synced(kubectl, "v4")
    deployment.verify("v4")
    pods = _live_runtime_pods(kubectl)
    assert [p["metadata"]["uid"] for p in pods] == [release.state["runtime_uid"]], "duplicate runtime pods"


def test_helm_upgrade_with_changed_values(
    release: Release, deployment: Deployment, kubectl: Any, helm: Any
) -> None:
    """helm upgrade (new metrics port, --verbose logging): a new operator pod with the new values,
    and the WeightSync keeps syncing."""
    old = _operator_pod(kubectl)
    assert old is not None
    port = free_port()
    values = _values(port, extra_args=["--verbose"])
    release.values_path.write_text(yaml.safe_dump(values))
    helm(
        "upgrade",
        RELEASE,
        str(CHART),
        "-n",
        NS,
        "-f",
        str(release.values_path),
        "--wait",
        "--timeout",
        "3m",
        timeout=240,
    )

    def upgraded() -> Any:
        pod = _operator_pod(kubectl)
        return pod if pod and pod["metadata"]["uid"] != old["metadata"]["uid"] else None

    pod = wait_for("the upgraded operator pod", upgraded, 120)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["WEIGHTSYNC_METRICS_PORT"] == str(port)
    assert "--verbose" in _cmdline(pod)
    revision = json.loads(helm("status", RELEASE, "-n", NS, "-o", "json").stdout)["version"]
    assert revision == 2
    deployment.train_step("v5")
    _set_version(kubectl, "v5")
    _wait_synced(kubectl, "v5")
    deployment.verify("v5")
    # The upgraded operator serves Prometheus metrics on the new port, on loopback only.
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    succeeded = re.search(r'^weightsync_syncs_total\{result="Succeeded"\} (\S+)$', metrics, re.M)
    assert succeeded and float(succeeded.group(1)) >= 1, metrics[:2000]
    assert re.search(r"^weightsync_synced_bytes_total \S+$", metrics, re.M), metrics[:2000]


def test_mixed_replica_is_degraded_named_in_status_and_repaired(
    release: Release, deployment: Deployment, kubectl: Any
) -> None:
    """One rank of replica 1 refuses its commit after the decision (its staged bytes no longer
    match): replica 0 serves v6, replica 1 holds v5 and v6, is kept out of serving, and status
    says so (Degraded/MixedVersions, status.replicas, the Serving column). The next sync repairs it."""
    bad, good = f"{DST_PREFIX}r1-pp0-tp0", f"{DST_PREFIX}r1-pp0-tp1"

    def mixed() -> Any:
        obj = _ws(kubectl)
        degraded = condition(obj, "Degraded") or {}
        return obj if (degraded.get("status"), degraded.get("reason")) == ("True", "MixedVersions") else None

    deployment.cluster.driver("corrupt", "--namespace", RAY_NS, "--name", bad, "--armed", "on")
    try:  # armed, every retry of v6 ends the same way: the state below holds still
        deployment.train_step("v6")
        _set_version(kubectl, "v6")
        try:
            obj = wait_for("Degraded with reason MixedVersions", mixed, SYNC_TIMEOUT)
        except AssertionError as e:  # say what status showed instead
            raise AssertionError(f"{e}; status: {json.dumps(_ws(kubectl).get('status'))[:6000]}") from None
        status = obj["status"]
        replicas = {r["replica"]: r for r in status["replicas"]}
        assert replicas[0]["state"] == "Serving" and replicas[0]["version"] == "v6", replicas
        assert replicas[1]["state"] == "Degraded" and replicas[1].get("version") is None, replicas
        assert replicas[1]["rankVersions"] == ["v5", "v6"], replicas
        assert status["serving"] == "1/2" and status["syncedVersion"] == "v5", status
        assert "replica 1 is Degraded (ranks on v5, v6)" in condition(obj, "Degraded")["message"]
        columns = kubectl("get", "weightsync", WS, "-n", NS).stdout
        assert re.search(r"\b1/2\b", columns), columns
        ranks = deployment.snapshot()  # every rank holds exactly the version it names
        assert all(r["exact"] for r in ranks.values()), ranks
        assert (ranks[bad]["version"], ranks[good]["version"]) == ("v5", "v6"), ranks
    finally:
        deployment.cluster.driver("corrupt", "--namespace", RAY_NS, "--name", bad, "--armed", "off")
    # The next sync (the runtime's own retry, or this new version) resends replica 1 in full.
    deployment.train_step("v7")
    _set_version(kubectl, "v7")
    obj = _wait_synced(kubectl, "v7")
    status = obj["status"]
    assert [(r["state"], r["version"]) for r in status["replicas"]] == [("Serving", "v7")] * 2, status
    assert status["serving"] == "2/2" and condition(obj, "Degraded")["status"] == "False", status
    deployment.verify("v7")


def test_destination_killed_mid_sync(release: Release, deployment: Deployment, kubectl: Any) -> None:
    """A destination rank dies mid-transfer: the sync fails with that rank named, Degraded, and the
    surviving destinations keep v7 bit-exact."""
    deployment.train_step("v8")
    victim = f"{DST_PREFIX}r1-pp0-tp1"
    with deployment.gate():
        _set_version(kubectl, "v8")
        deployment.wait_at_gate()
        _wait_syncing(kubectl, "v8")
        deployment.cluster.driver("kill", "--namespace", RAY_NS, "--name", victim)

    def failed() -> Any:
        obj = _ws(kubectl)
        return obj if (obj.get("status") or {}).get("phase") == "Failed" else None

    obj = wait_for("phase Failed", failed, SYNC_TIMEOUT)
    status = obj["status"]
    assert status["syncedVersion"] == "v7", status
    degraded, synced = condition(obj, "Degraded"), condition(obj, "Synced")
    assert degraded is not None and degraded["status"] == "True", status["conditions"]
    assert synced is not None and synced["status"] == "False", status["conditions"]
    failure = status["lastSync"]["failure"]
    assert status["lastSync"]["result"] == "Failed", status["lastSync"]
    # The sync that lost the rank names it (global ranks: sources 0-1, then destinations in
    # (replica, tp) order: r1-tp1 is rank 5). The runtime retries a ParticipantDied; when the
    # retry ran before this read, its discovery names the same rank by coordinates instead. When
    # the report names replica 1 out of serving (its dead rank holds no version), Degraded's reason
    # says so (MixedVersions) and its message carries the failure too.
    if failure["reason"] == "TopologyMismatch":
        assert failure["step"] == "discover" and "missing rank replica=1,pp=0,tp=1" in failure["message"], (
            failure
        )
        assert "missing rank replica=1,pp=0,tp=1" in degraded["message"], degraded
    else:
        assert failure["reason"] == "ParticipantDied" and failure.get("rank") == 5, failure
        assert re.search(r"\brank 5\b", degraded["message"]), degraded
    ranks = deployment.snapshot()
    # A killed named actor drops out of Ray's name table (or answers as dead).
    alive = {n: r for n, r in ranks.items() if not r.get("dead")}
    assert victim not in alive and len(alive) == DST_RANKS - 1, ranks
    assert all(r["version"] == "v7" and r["exact"] for r in alive.values()), alive
    warning = [e for e in events_for(kubectl, NS, WS) if e["reason"] == "SyncFailed"]
    # Event lists are not in time order: look for the one about v8.
    assert any(e["type"] == "Warning" and "v8" in e["message"] for e in warning), warning


def test_deleting_the_weightsync_garbage_collects_its_pod(release: Release, kubectl: Any) -> None:
    assert _live_runtime_pods(kubectl)
    kubectl("delete", "weightsync", WS, "-n", NS, "--wait=true", "--timeout=60s", timeout=90)
    wait_for("runtime pod garbage-collected", lambda: not runtime_pods(kubectl, NS, WS), 90)


def test_helm_uninstall_removes_the_operator_and_keeps_the_crd(
    release: Release, kubectl: Any, helm: Any
) -> None:
    """helm uninstall removes what the chart templated; the CRD (chart crds/) is left in place, as
    Helm documents for crds/ (delete it with kubectl when no WeightSync should survive)."""
    helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m", timeout=180)
    wait_for(
        "operator Deployment and pods gone",
        lambda: (
            not get_json(kubectl, "deploy", "-n", NS, "-l", "app.kubernetes.io/instance=" + RELEASE)["items"]
            and not (
                get_json(kubectl, "pods", "-n", NS, "-l", "app.kubernetes.io/name=weightsync-operator") or {}
            ).get("items")
        ),
        120,
    )
    assert not get_json(kubectl, "sa", "-n", NS, "-l", "app.kubernetes.io/instance=" + RELEASE)["items"]
    assert get_json(kubectl, "crd", "weightsyncs.weightsync.io") is not None, "helm must not delete crds/"
