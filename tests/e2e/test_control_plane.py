"""The e2e test infrastructure itself: control plane, controllers, node agent, kubectl, helm."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

K8S_VERSION = "v1.35.4"


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = fn()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def get(cp: Any, path: str) -> Any:
    try:
        return cp.get_json(path)
    except Exception as e:
        if getattr(e, "code", None) == 404:
            return None
        raise


def apply(cp: Any, *objs: dict[str, Any]) -> None:
    cp.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    )


def python_pod(name: str, ns: str, code: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "ignored", "command": [sys.executable, "-c", code]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"containers": [container], **spec},
    }


def pod_phase(cp: Any, ns: str, name: str, phases: tuple[str, ...]) -> dict[str, Any]:
    def check() -> Any:
        pod = get(cp, f"/api/v1/namespaces/{ns}/pods/{name}")
        return pod if pod and pod.get("status", {}).get("phase") in phases else None

    return wait_for(f"pod {ns}/{name} in {phases}", check)  # type: ignore[no-any-return]


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_version_reports_release(control_plane: Any, kubectl: Any) -> None:
    assert control_plane.get_json("/version")["gitVersion"] == K8S_VERSION
    out = json.loads(kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == K8S_VERSION
    assert out["clientVersion"]["minor"].startswith("35")


def _listening(pid: int) -> list[str]:
    """host:port of every TCP socket in LISTEN state owned by ``pid`` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)
                # /proc/net stores addresses as native-endian 32-bit words
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
                ip = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, b"".join(words))
                found.append(f"{ip}:{int(port, 16)}")
    return found


def test_control_plane_listens_only_on_loopback(control_plane: Any) -> None:
    for name, proc in control_plane.procs.items():
        addrs = _listening(proc.pid)
        assert addrs, f"{name} listens nowhere?"
        assert all(a.startswith("127.0.0.1:") for a in addrs), (name, addrs)


def test_kubectl_get_namespaces(kubectl: Any) -> None:
    names = kubectl("get", "ns", "-o", "name").stdout.split()
    assert {"namespace/default", "namespace/kube-system"} <= set(names)


def test_kubectl_and_helm_clients(kubectl: Any, helm: Any) -> None:
    client = json.loads(kubectl("version", "--client", "-o", "json").stdout)["clientVersion"]
    assert client["major"] == "1"
    assert helm("version", "--short").stdout.strip().startswith("v")


def test_helm_installs_chart(control_plane: Any, helm: Any, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: demo-cm}
        data: {value: {{ .Values.value | quote }}}
        """)
    )
    helm("install", "demo", str(chart), "-n", namespace, "--set", "value=42", "--wait")
    cm = control_plane.get_json(f"/api/v1/namespaces/{namespace}/configmaps/demo-cm")
    assert cm["data"] == {"value": "42"}
    assert "demo" in helm("list", "-n", namespace, "-q").stdout.split()


def test_pod_gets_secret_configmap_and_token(control_plane: Any, node_agent: Any, namespace: str) -> None:
    code = textwrap.dedent("""\
        import base64, json, os, ssl, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        token = open(sa + "/token").read()
        claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
        url = "https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews" % (
            os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        req = urllib.request.Request(url, body.encode(), method="POST", headers={
            "Authorization": "Bearer " + token, "Content-Type": "application/json"})
        ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
        review = json.load(urllib.request.urlopen(req, context=ctx))
        out = {"password": os.environ["PASSWORD"], "pod": os.environ["POD_NAME"],
               "greeting": open("/etc/ws-config/greeting").read(),
               "namespace": open(sa + "/namespace").read(), "sub": claims["sub"],
               "user": review["status"]["userInfo"]["username"], "cwd": os.getcwd()}
        open("/dev/termination-log", "w").write(json.dumps(out))
        print("done")
        """)
    ns = namespace
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "runner", "namespace": ns}}
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cfg", "namespace": ns},
        "data": {"greeting": "hello-from-configmap"},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "sec", "namespace": ns},
        "stringData": {"password": "s3cret"},
    }
    workdir = Path(node_agent.workdir) / "wd"
    pod = python_pod(
        "reader",
        ns,
        code,
        restartPolicy="Never",
        serviceAccountName="runner",
        volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}],
        container={
            "workingDir": str(workdir),
            "volumeMounts": [{"name": "cfg", "mountPath": "/etc/ws-config"}],
            "env": [
                {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
        },
    )
    apply(control_plane, sa, cm, secret)
    apply(control_plane, pod)
    done = pod_phase(control_plane, ns, "reader", ("Succeeded", "Failed"))
    status = done["status"]["containerStatuses"][0]
    terminated = status["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", (terminated, node_agent.logs(ns, "reader"))
    assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed"
    assert json.loads(terminated["message"]) == {
        "password": "s3cret",
        "pod": "reader",
        "greeting": "hello-from-configmap",
        "namespace": ns,
        "sub": f"system:serviceaccount:{ns}:runner",
        "user": f"system:serviceaccount:{ns}:runner",
        "cwd": str(workdir),
    }
    assert done["spec"]["nodeName"] == node_agent.node_name
    assert done["status"]["podIP"] == "127.0.0.1"
    conds = {c["type"]: c["status"] for c in done["status"]["conditions"]}
    assert conds["PodScheduled"] == "True" and conds["Initialized"] == "True"
    assert node_agent.logs(ns, "reader").strip() == "done"


def test_in_cluster_client_is_bound_by_rbac(control_plane: Any, node_agent: Any, namespace: str) -> None:
    """The kubernetes client's in-cluster config works in a pod, with the pod's own RBAC."""
    code = textwrap.dedent("""\
        import json, os
        from kubernetes import client, config
        config.load_incluster_config()
        v1 = client.CoreV1Api()
        pods = [p.metadata.name for p in v1.list_namespaced_pod(os.environ["NS"]).items]
        try:
            v1.list_namespaced_secret("kube-system")
            secrets = "allowed"
        except client.ApiException as e:
            secrets = e.status
        open("/dev/termination-log", "w").write(json.dumps({"pods": pods, "secrets": secrets}))
        """)
    ns = namespace
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "pod-reader", "namespace": ns},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "pod-reader", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}],
    }
    pod = python_pod(
        "incluster", ns, code, restartPolicy="Never", container={"env": [{"name": "NS", "value": ns}]}
    )
    apply(control_plane, role, binding)
    apply(control_plane, pod)
    done = pod_phase(control_plane, ns, "incluster", ("Succeeded", "Failed"))
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", (terminated, node_agent.logs(ns, "incluster"))
    assert json.loads(terminated["message"]) == {"pods": ["incluster"], "secrets": 403}


def test_node_is_registered_ready_with_lease(control_plane: Any, node_agent: Any) -> None:
    node = control_plane.get_json(f"/api/v1/nodes/{node_agent.node_name}")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert node["status"]["allocatable"]["pods"] == "110"
    lease = control_plane.get_json(
        f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node_agent.node_name}"
    )
    assert lease["spec"]["holderIdentity"] == node_agent.node_name


def test_init_container_and_empty_dir(control_plane: Any, node_agent: Any, namespace: str) -> None:
    init = {
        "name": "init",
        "image": "ignored",
        "command": [sys.executable, "-c", "open('/scratch/f', 'w').write('from-init')"],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    }
    code = "import sys; sys.stdout.write(open('/scratch/f').read())"
    pod = python_pod(
        "init",
        namespace,
        code,
        restartPolicy="Never",
        initContainers=[init],
        volumes=[{"name": "scratch", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
    )
    apply(control_plane, pod)
    done = pod_phase(control_plane, namespace, "init", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded", node_agent.logs(namespace, "init")
    assert done["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert node_agent.logs(namespace, "init", "main") == "from-init"


def test_restart_policy_always_restarts_crashing_container(
    control_plane: Any, node_agent: Any, namespace: str
) -> None:
    apply(control_plane, python_pod("crasher", namespace, "import sys; sys.exit(1)"))

    def restarted_twice() -> Any:
        pod = get(control_plane, f"/api/v1/namespaces/{namespace}/pods/crasher")
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount", 0) >= 2 else None

    pod = wait_for("two restarts", restarted_twice, timeout=30)
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1


def test_kubeconfig_fallback_without_mount_namespace(
    control_plane: Any, start_node_agent: Any, namespace: str
) -> None:
    """With --no-mount-ns the pod gets KUBECONFIG (its own token) and WEIGHTSYNC_VOLUMES."""
    agent = start_node_agent("node-fallback", "--no-mount-ns")
    assert "KUBECONFIG fallback" in agent.agent_log()
    code = textwrap.dedent("""\
        import json, os
        from kubernetes import client, config
        config.load_kube_config()
        review = client.AuthenticationV1Api().create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        greeting = open(os.environ["WEIGHTSYNC_VOLUMES"] + "/cfg/greeting").read()
        print(json.dumps({"user": review.status.user_info.username, "greeting": greeting}))
        """)
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cfg", "namespace": namespace},
        "data": {"greeting": "hi"},
    }
    pod = python_pod(
        "fallback",
        namespace,
        code,
        restartPolicy="Never",
        nodeName="node-fallback",
        volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}],
        container={"volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]},
    )
    apply(control_plane, cm)
    apply(control_plane, pod)
    done = pod_phase(control_plane, namespace, "fallback", ("Succeeded", "Failed"))
    log = agent.logs(namespace, "fallback")
    assert done["status"]["phase"] == "Succeeded", log
    assert json.loads(log) == {"user": f"system:serviceaccount:{namespace}:default", "greeting": "hi"}


def test_failing_pod_reports_exit_code(control_plane: Any, node_agent: Any, namespace: str) -> None:
    code = "import sys; print('boom'); sys.exit(3)"
    pod = python_pod(
        "fails",
        namespace,
        code,
        restartPolicy="Never",
        container={"terminationMessagePolicy": "FallbackToLogsOnError"},
    )
    apply(control_plane, pod)
    done = pod_phase(control_plane, namespace, "fails", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Failed"
    status = done["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0
    terminated = status["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    assert terminated["message"].strip() == "boom"


def test_on_failure_pod_restarts_until_success(control_plane: Any, node_agent: Any, namespace: str) -> None:
    # Fails on its first two runs (counted in a file in the working dir), then succeeds.
    counter = Path(node_agent.workdir) / f"{namespace}-count"
    code = textwrap.dedent(f"""\
        import pathlib, sys
        p = pathlib.Path({str(counter)!r})
        n = int(p.read_text()) if p.exists() else 0
        p.write_text(str(n + 1))
        sys.exit(0 if n >= 2 else 1)
        """)
    apply(control_plane, python_pod("flaky", namespace, code, restartPolicy="OnFailure"))
    done = pod_phase(control_plane, namespace, "flaky", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded"
    status = done["status"]["containerStatuses"][0]
    assert status["restartCount"] == 2
    assert status["lastState"]["terminated"]["exitCode"] == 1


def _running_pod(cp: Any, ns: str, selector: str = "") -> dict[str, Any]:
    def check() -> Any:
        pods = cp.get_json(f"/api/v1/namespaces/{ns}/pods{selector}")["items"]
        ready = [
            p
            for p in pods
            if p.get("status", {}).get("phase") == "Running"
            and {"type": "Ready", "status": "True"}.items()
            <= next((c for c in p["status"]["conditions"] if c["type"] == "Ready"), {}).items()
        ]
        return ready[0] if ready else None

    return wait_for(f"a Running+Ready pod in {ns}", check)  # type: ignore[no-any-return]


def _pid(pod: dict[str, Any]) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("local://"))


def test_deployment_runs_and_gc_cleans_up(control_plane: Any, node_agent: Any, namespace: str) -> None:
    ns = namespace
    template = python_pod("x", ns, "import time; print('up', flush=True); time.sleep(3600)")
    template["metadata"] = {"labels": {"app": "sleeper"}}
    template["spec"]["terminationGracePeriodSeconds"] = 1
    template["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sleeper", "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "sleeper"}},
            "template": {k: v for k, v in template.items() if k in ("metadata", "spec")},
        },
    }
    apply(control_plane, deploy)
    rs_path = f"/apis/apps/v1/namespaces/{ns}/replicasets"
    rs = wait_for("ReplicaSet", lambda: control_plane.get_json(rs_path)["items"])[0]
    assert rs["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    pod = _running_pod(control_plane, ns)
    assert pod["metadata"]["ownerReferences"][0]["name"] == rs["metadata"]["name"]
    pid = _pid(pod)
    assert pid_alive(pid)
    wait_for("pod log", lambda: "up" in node_agent.logs(ns, pod["metadata"]["name"]))
    deploy_obj = f"/apis/apps/v1/namespaces/{ns}/deployments/sleeper"
    wait_for(
        "deployment available",
        lambda: control_plane.get_json(deploy_obj).get("status", {}).get("availableReplicas") == 1,
    )

    control_plane.kubectl("delete", "deployment", "sleeper", "-n", ns, "--wait=false")
    wait_for("ReplicaSet garbage-collected", lambda: not control_plane.get_json(rs_path)["items"])
    pods = f"/api/v1/namespaces/{ns}/pods"
    wait_for("Pods garbage-collected", lambda: not control_plane.get_json(pods)["items"])
    wait_for("process killed", lambda: not pid_alive(pid), timeout=10)


def test_deleting_running_pod_kills_process(control_plane: Any, node_agent: Any, namespace: str) -> None:
    # Ignores SIGTERM, so the agent must escalate to SIGKILL after the grace period.
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
    apply(control_plane, python_pod("victim", namespace, code, terminationGracePeriodSeconds=2))
    pod = _running_pod(control_plane, namespace)
    pid = _pid(pod)
    assert pid_alive(pid)
    assert os.getpgid(pid) == pid  # its own process group
    t0 = time.monotonic()
    control_plane.kubectl("delete", "pod", "victim", "-n", namespace, "--wait=true", timeout=60)
    assert not pid_alive(pid)
    assert get(control_plane, f"/api/v1/namespaces/{namespace}/pods/victim") is None
    assert time.monotonic() - t0 < 30
