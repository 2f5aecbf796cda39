"""Trust boundary, end to end: what a WeightSync author, or a runtime's token, can make happen.

One Helm release (single-namespace mode, its own namespace) and the real kube-apiserver, RBAC,
ValidatingAdmissionPolicy and operator. Each row of HOSTILE is a hostile or mistaken input; each
must be refused with its reason and change nothing. The store key forged from outside the sync's
prefix is tests/test_store_boundary.py (a real TCPStore; no Kubernetes involved).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import free_port
from helpers import condition, get_json, runtime_pods, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weightsync-operator"
NS, RELEASE, SECRET = "ws-trust", "wst", "ray-token"
OWN, OTHER = "own", "other"
"""OWN's runtime pod lends its token to the cases; OTHER is the WeightSync it must not touch."""
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/opt/venv/lib/python3.12/site-packages/sync_runtime/runtime/loop.py", line 9, in run\n'
    '    token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()\n'
    "RuntimeError: plan refused"
)


def ws(name: str, **spec: Any) -> dict[str, Any]:
    """A valid WeightSync whose Ray cluster does not exist (its runtime keeps connecting)."""
    ref = {"rayAddress": "127.0.0.1:1", "layout": "hf", "authSecretRef": {"name": SECRET}}
    body = {
        "version": "v1",
        "source": {"name": "trainer", "actorPrefix": "t-", **ref},
        "destinations": [{"name": "rollout", "actorPrefix": "v-", **ref}],
        "retry": {"limit": 0, "backoffSeconds": 3600, "maxBackoffSeconds": 3600},
        **spec,
    }
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": name},
        "spec": body,
    }


@dataclass
class Trust:
    kubectl: Any
    runtime_kubeconfig: Path
    workdir: Path

    def as_runtime(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """kubectl with OWN's runtime token (bound to its pod) and nothing else."""
        return self.kubectl("--kubeconfig", str(self.runtime_kubeconfig), *args, input=input, check=False)

    def patch_status(self, name: str, patch: str) -> subprocess.CompletedProcess[str]:
        """The runtime's own write (sync_runtime.kube.status): a merge patch on /status with
        OWN's token, without kubectl's GET first (the runtime may not get weightsyncs/status)."""
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException

        api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(self.runtime_kubeconfig)))
        args = ("weightsync.io", "v1alpha1", NS, "weightsyncs", name, json.loads(patch))
        try:
            api.patch_namespaced_custom_object_status(*args, _content_type="application/merge-patch+json")
        except ApiException as e:
            return subprocess.CompletedProcess([], 1, "", f"{e.status}: {e.body}")
        return subprocess.CompletedProcess([], 0, "", "")

    def apply(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(manifest), check=False)


def _token_kubeconfig(control_plane: Any, kubectl: Any, path: Path) -> Path:
    pod = wait_for("OWN's runtime pod", lambda: runtime_pods(kubectl, NS, OWN), 60)[0]["metadata"]
    token = kubectl(
        "create", "token", "weightsync-runtime", "-n", NS, "--bound-object-kind=Pod",
        f"--bound-object-name={pod['name']}", f"--bound-object-uid={pod['uid']}",
    ).stdout.strip()  # fmt: skip
    cluster = {"server": control_plane.server, "certificate-authority": str(control_plane.ca_path)}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": cluster}],
        "users": [{"name": "rt", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "rt", "namespace": NS}}],
        "current-context": "t",
    }
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def trust(
    control_plane: Any, node_agent: Any, kubectl: Any, helm: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Trust]:
    work = tmp_path_factory.mktemp("trust")
    kubectl("create", "namespace", NS)
    wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", NS), 30)
    kubectl("create", "secret", "generic", SECRET, "-n", NS, "--from-literal=token=not-a-real-token")
    values = {
        "watchNamespace": NS,
        "operator": {"command": ["kopf"], "healthPort": 0, "reconcileIntervalSeconds": 1},
        "bindAddress": "127.0.0.1",
        "metrics": {"port": free_port()},
    }
    (work / "values.yaml").write_text(yaml.safe_dump(values))
    helm("install", RELEASE, str(CHART), "-n", NS, "-f", str(work / "values.yaml"), "--wait", timeout=240)
    try:
        for name in (OWN, OTHER):
            kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(ws(name)))
        yield Trust(kubectl, _token_kubeconfig(control_plane, kubectl, work / "runtime.kubeconfig"), work)
    finally:
        helm("uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=120)
        kubectl("delete", "namespace", NS, "--wait=false", check=False)


# ---- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    name: str
    kind: str
    """apply: `kubectl apply` refuses; operator: accepted, the operator refuses and creates nothing;
    runtime / status: OWN's runtime token is refused (kubectl; a status patch made the way the
    runtime makes it); can-i: RBAC says no to that ServiceAccount."""
    manifest: dict[str, Any] | None = None
    args: tuple[str, ...] = ()
    expect: str = ""


RUNTIME_SA = f"system:serviceaccount:{NS}:weightsync-runtime"
OPERATOR_SA = f"system:serviceaccount:{NS}:{RELEASE}-weightsync-operator"
FORGED = json.dumps({"status": {"runtime": {"phase": "Idle", "version": "v1"}, "syncedVersion": "v1"}})
HOSTILE = [
    Hostile("foreign-image", "operator", ws("h-image", runtime={"image": "evil.example/miner:1"})),
    Hostile(
        "foreign-service-account",
        "apply",
        ws("h-sa", runtime={"serviceAccountName": f"{RELEASE}-weightsync-operator"}),
        expect='unknown field "spec.runtime.serviceAccountName"',
    ),
    Hostile(
        "env-secret-reference",
        "apply",
        ws(
            "h-secret",
            runtime={"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "token"}}}]},
        ),
        expect='unknown field "spec.runtime.env[0].valueFrom.secretKeyRef"',
    ),
    Hostile(
        "env-configmap-reference",
        "operator",
        ws(
            "h-cm",
            runtime={"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
        ),
    ),
    Hostile(
        "env-api-server-redirect",
        "operator",
        ws("h-kube", runtime={"env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "evil.example"}]}),
    ),
    Hostile(
        "env-code-injection",
        "operator",
        ws("h-ld", runtime={"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}),
    ),
    Hostile(
        "ray-without-token-auth",
        "apply",
        ws(
            "h-noauth", destinations=[{"name": "r", "rayAddress": "h:1", "actorPrefix": "v-", "layout": "hf"}]
        ),
        expect="unless allowUnauthenticatedRay is true",
    ),
    Hostile(
        "status-forgery-with-runtime-token",
        "status",
        args=(OTHER, FORGED),
        expect="a runtime may write the status of its own WeightSync only",
    ),
    Hostile(
        "runtime-token-patches-spec",
        "runtime",
        args=("patch", "weightsync", OWN, "--type=merge", "-p", '{"spec":{"version":"v666"}}'),
        expect="cannot patch resource",
    ),
    Hostile(
        "runtime-token-reads-secrets", "runtime", args=("get", "secret", SECRET), expect="cannot get resource"
    ),
    Hostile("runtime-token-creates-pods", "runtime", args=("auth", "can-i", "create", "pods"), expect="no"),
    *[
        Hostile(
            f"runtime-can-i-{'-'.join(a.removeprefix('--subresource=') for a in q)}",
            "can-i",
            args=(*q, f"--as={RUNTIME_SA}"),
            expect="no",
        )
        for q in (
            ("delete", "weightsyncs"),
            ("update", "weightsyncs"),
            ("get", "secrets"),
            ("create", "serviceaccounts", "--subresource=token"),
        )
    ],
    *[
        Hostile(
            f"operator-can-i-{'-'.join(a.removeprefix('--subresource=') for a in q)}",
            "can-i",
            args=(*q, f"--as={OPERATOR_SA}"),
            expect="no",
        )
        for q in (
            ("get", "secrets"),
            ("create", "pods", "--subresource=exec"),
            ("create", "serviceaccounts", "--subresource=token"),
            ("create", "roles"),
            ("escalate", "roles"),
            ("create", "clusterrolebindings"),
            ("delete", "weightsyncs"),
            ("*", "*"),
        )
    ],
]


def _snapshot(trust: Trust) -> dict[str, Any]:
    """What must not change: OTHER's status, the set of runtime pods, the WeightSyncs."""
    other = get_json(trust.kubectl, "weightsync", OTHER, "-n", NS)
    pods = get_json(trust.kubectl, "pods", "-n", NS, "-l", "app.kubernetes.io/name=weightsync-runtime")
    names = get_json(trust.kubectl, "weightsyncs", "-n", NS)
    return {
        # Not resourceVersion: OTHER's own runtime and the operator write its status meanwhile.
        "other": (
            other["metadata"]["generation"],
            other.get("status", {}).get("syncedVersion"),
            (other.get("status", {}).get("runtime") or {}).get("phase") == "Idle",  # what FORGED sets
        ),
        "own-spec": get_json(trust.kubectl, "weightsync", OWN, "-n", NS)["spec"]["version"],
        "pods": sorted(p["metadata"]["name"] for p in pods["items"]),
        "weightsyncs": sorted(w["metadata"]["name"] for w in names["items"]),
    }


def _refused_by_operator(trust: Trust, case: Hostile) -> None:
    assert case.manifest is not None
    name = case.manifest["metadata"]["name"]
    applied = trust.apply(case.manifest)
    assert applied.returncode == 0, applied.stderr
    try:

        def refused() -> Any:
            c = condition(get_json(trust.kubectl, "weightsync", name, "-n", NS), "Degraded")
            return c if c and c["reason"] == "RuntimeOverrideRefused" else None

        c = wait_for(f"{case.name}: RuntimeOverrideRefused", refused, 60)
        assert c["status"] == "True" and "spec.runtime" in c["message"], c
        time.sleep(2)  # a few reconciles later there is still no pod
        assert runtime_pods(trust.kubectl, NS, name) == []
    finally:
        trust.kubectl("delete", "weightsync", name, "-n", NS, "--wait=false", check=False)


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.name)
def test_hostile_input_is_refused_and_changes_nothing(trust: Trust, case: Hostile) -> None:
    before = _snapshot(trust)
    if case.kind == "operator":
        _refused_by_operator(trust, case)
        return
    if case.kind == "apply":
        assert case.manifest is not None
        proc = trust.apply(case.manifest)
    elif case.kind == "runtime":
        proc = trust.as_runtime(*case.args)
    elif case.kind == "status":
        proc = trust.patch_status(*case.args)
    else:
        proc = trust.kubectl("auth", "can-i", *case.args, "-n", NS, check=False)
    assert proc.returncode != 0, f"{case.name}: allowed: {proc.stdout}"
    assert case.expect in proc.stdout + proc.stderr, f"{case.name}: {proc.stdout}{proc.stderr}"
    assert _snapshot(trust) == before


def test_the_runtime_token_writes_its_own_status_and_the_rbac_it_needs(trust: Trust) -> None:
    """The other side of the table: the runtime can still do its job, the operator its own."""
    assert trust.as_runtime("get", "weightsync", OWN, "-o", "name").returncode == 0
    ok = trust.patch_status(OWN, '{"status": {"runtime": {"podName": "own-runtime"}}}')
    assert ok.returncode == 0, ok.stderr
    for verb, res in (("create", "pods"), ("patch", "weightsyncs/status"), ("create", "events")):
        assert (
            trust.kubectl("auth", "can-i", verb, res, f"--as={OPERATOR_SA}", "-n", NS).stdout.strip() == "yes"
        )


def test_a_traceback_from_the_runtime_does_not_reach_conditions(trust: Trust) -> None:
    """A runtime (its own token, its own WeightSync) reports a failure whose message is a traceback;
    the operator's conditions carry its last line only."""
    pod = runtime_pods(trust.kubectl, NS, OWN)[0]["metadata"]
    body = {
        "phase": "Failed",
        "reason": "PlanRefused",
        "message": TRACEBACK,
        "podUid": pod["uid"],
        "podName": pod["name"],
    }
    patch = json.dumps({"status": {"runtime": body}})

    def reported() -> Any:
        c = condition(get_json(trust.kubectl, "weightsync", OWN, "-n", NS), "RuntimeReady")
        if c and c["reason"] == "PlanRefused":
            return c
        # The runtime itself may have overwritten the report meanwhile (it is connecting): again.
        proc = trust.patch_status(OWN, patch)
        assert proc.returncode == 0, proc.stderr
        return None

    c = wait_for("RuntimeReady=False reason PlanRefused", reported, 120, interval=2)
    assert c["message"] == "RuntimeError: plan refused (details in the runtime's log)", c
    status = get_json(trust.kubectl, "weightsync", OWN, "-n", NS)["status"]
    for cond in status["conditions"]:
        assert "Traceback" not in cond["message"] and 'File "' not in cond["message"], cond
