"""vllmServers destinations against a real kube-apiserver (no Ray, no vLLM).

- The CRD's schema and CEL: a WeightSync naming server pods by label is accepted (port
  defaulted); each bad form of it in tests/bad_manifests is refused with its message.
- Resolution with the runtime's own identity: the chart's runtime Role (rendered by helm) lets a
  token of the `weightsync-runtime` ServiceAccount list the pods; the Ready ones, ordered by
  name, are the replicas; a declared replica count the Ready pods do not make is refused naming
  the pod that is not serving; a ServiceAccount without the Role is refused in one line (403).

Pods here never run (their nodeSelector matches no node); their status (Ready, pod IP) is
written through the status subresource, as a kubelet would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from bad_manifests.cases import load_cases

from sync_runtime.errors import DiscoveryError
from sync_runtime.kube.pods import check_servers, list_server_pods

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "weightsyncs.weightsync.io.yaml"
CHART = ROOT / "charts" / "weightsync-operator"
SERVER_CASES = {
    "servers-and-actor-prefix",
    "servers-with-ray-address",
    "servers-hf-layout",
    "pause-without-servers",
    "source-names-servers",
    "source-without-actor-prefix",
    "pause-mode-unknown",
}


def _install_crd(kubectl: Any) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io", "--timeout=60s")


def _manifest(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": "servers", "namespace": namespace},
        "spec": {
            "version": "v1",
            "source": {
                "name": "trainer",
                "rayAddress": "10.0.0.1:6379",
                "actorPrefix": "trainer-",
                "layout": "megatron",
                "authSecretRef": {"name": "ray"},
            },
            "destinations": [
                {
                    "name": "rollout",
                    "layout": "vllm",
                    "pause": "wait",
                    "vllmServers": {"selector": {"matchLabels": {"app": "vllm"}}},
                    "parallelism": {"tp": 1, "replicas": 2},
                }
            ],
        },
    }


def test_api_server_takes_a_servers_destination_and_refuses_bad_ones(kubectl: Any, namespace: str) -> None:
    _install_crd(kubectl)
    kubectl("apply", "-f", "-", input=json.dumps(_manifest(namespace)))
    stored = json.loads(kubectl("get", "ws", "servers", "-n", namespace, "-o", "json").stdout)
    (dest,) = stored["spec"]["destinations"]
    # the apiserver fills the schema's defaults: the port, and one DP engine per server
    want = {"selector": {"matchLabels": {"app": "vllm"}}, "port": 8000, "dataParallelSize": 1}
    assert dest["vllmServers"] == want
    assert dest["pause"] == "wait" and "actorPrefix" not in dest and "authSecretRef" not in dest
    cases = [c for c in load_cases() if c.name in SERVER_CASES]
    assert {c.name for c in cases} == SERVER_CASES
    for case in cases:
        doc = {**case.manifest, "metadata": {**case.manifest["metadata"], "namespace": namespace}}
        proc = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
        assert proc.returncode != 0, f"{case.name}: accepted"
        for expected in case.expect:
            assert expected in proc.stderr, f"{case.name}: {expected!r} not in {proc.stderr!r}"


def _pod(name: str, app: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeSelector": {"weightsync-test": "no-such-node"},  # never scheduled, never run
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}],
        },
    }


def _ready(kubectl: Any, namespace: str, name: str, ip: str, restarts: int = 0) -> None:
    container = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.32.0",
        "imageID": "",
        "ready": True,
        "restartCount": restarts,
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
    }
    status = {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [container],
        }
    }
    kubectl(
        "patch",
        "pod",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )


def _token_api(control_plane: Any, kubectl: Any, namespace: str, account: str, path: Path) -> Any:
    from kubernetes import client, config

    token = kubectl("create", "token", account, "-n", namespace).stdout.strip()
    cluster = {"server": control_plane.server, "certificate-authority": str(control_plane.ca_path)}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "t", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u", "namespace": namespace}}],
        "current-context": "t",
    }
    path.write_text(json.dumps(cfg))
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))


def test_runtime_lists_the_ready_server_pods_with_its_own_role(
    control_plane: Any, kubectl: Any, helm: Any, namespace: str, tmp_path: Path
) -> None:
    rbac = helm(
        "template", "ws", str(CHART), "--namespace", "ws-system",
        "--show-only", "templates/runtime-rbac.yaml", "--set", f"runtime.namespaces={{{namespace}}}",
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rbac) if d]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding"}
    kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))
    for name, app in (("vllm-2", "vllm"), ("vllm-0", "vllm"), ("vllm-1", "vllm"), ("other-0", "other")):
        kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_pod(name, app)))
    _ready(kubectl, namespace, "vllm-0", "10.0.0.10")
    _ready(kubectl, namespace, "vllm-2", "10.0.0.12", restarts=2)
    _ready(kubectl, namespace, "other-0", "10.0.0.99")

    api = _token_api(control_plane, kubectl, namespace, "weightsync-runtime", tmp_path / "rt.kubeconfig")
    pods = list_server_pods(namespace, {"app": "vllm"}, api=api)
    assert sorted(p.name for p in pods) == ["vllm-0", "vllm-1", "vllm-2"]  # other-0 not selected
    assert {p.name: (p.ready, p.restarts) for p in pods} == {
        "vllm-0": (True, 0),
        "vllm-1": (False, 0),
        "vllm-2": (True, 2),  # a restarted container: the runtime attaches its server again
    }
    found = check_servers("rollout", "app=vllm", pods, 2, 8000)
    assert [(e.replica, e.pod, e.url) for e in found] == [
        (0, "vllm-0", "http://10.0.0.10:8000"),
        (1, "vllm-2", "http://10.0.0.12:8000"),
    ]
    assert all(e.uid for e in found)
    with pytest.raises(DiscoveryError, match="expected replicas=3; not serving: vllm-1"):
        check_servers("rollout", "app=vllm", pods, 3, 8000)

    # Negative control: the same listing without the runtime Role is refused, in one line.
    kubectl("create", "serviceaccount", "no-role", "-n", namespace)
    other = _token_api(control_plane, kubectl, namespace, "no-role", tmp_path / "none.kubeconfig")
    with pytest.raises(DiscoveryError) as e:
        list_server_pods(namespace, {"app": "vllm"}, api=other)
    assert "HTTP 403" in e.value.message and "needs list on pods" in e.value.message
    assert "\n" not in e.value.message
