"""Helm chart: lint, template (default and single-namespace), exact RBAC, CRD copy, documented values.

Runs the real `helm`: from the control-plane cache (tests/k8s/ensure_binaries.sh) or PATH. Without
helm the tests skip locally and FAIL under CI=true.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sync_runtime.testing.reference_cache import cache_root

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "weightsync-operator"

OPERATOR_RULES = {
    ("weightsync.io", "weightsyncs"): {"get", "list", "watch", "patch"},
    ("weightsync.io", "weightsyncs/status"): {"get", "patch"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "events"): {"create"},
}
RUNTIME_RULES = {
    ("weightsync.io", "weightsyncs"): {"get", "list", "watch"},
    ("weightsync.io", "weightsyncs/status"): {"patch"},
    ("ray.io", "rayclusters"): {"get"},
    ("", "pods"): {"list"},
}


def find_helm() -> str | None:
    for candidate in sorted(glob.glob(str(cache_root() / "k8s-*" / "bin" / "helm")), reverse=True):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("helm")


@pytest.fixture(scope="module")
def helm() -> str:
    path = find_helm()
    if path is None:  # make test installs it; a chart test never passes by skipping
        pytest.fail("helm not found: run tests/k8s/ensure_binaries.sh (make test does)")
    return path


def run(helm: str, *args: str) -> str:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def render(helm: str, *sets: str) -> list[dict]:
    args = ["template", "ws", str(CHART), "--namespace", "ws-system"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(run(helm, *args)) if d]


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_chart_crd_is_the_top_level_crd() -> None:
    top = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert top == chart, "run `make chart-crds`"
    for name in top:
        assert (ROOT / "crds" / name).read_bytes() == (CHART / "crds" / name).read_bytes(), (
            "run `make chart-crds`"
        )


@pytest.mark.parametrize("sets", [(), ("watchNamespace=team-a",)])
def test_helm_lint_strict(helm: str, sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    run(helm, *args)


def test_default_values_cluster_wide(helm: str) -> None:
    docs = render(helm)
    (cr,) = by_kind(docs, "ClusterRole")
    assert rules_of(cr) == OPERATOR_RULES
    (crb,) = by_kind(docs, "ClusterRoleBinding")
    assert crb["subjects"] == [
        {"kind": "ServiceAccount", "name": "ws-weightsync-operator", "namespace": "ws-system"}
    ]
    (role,) = by_kind(docs, "Role")  # only the runtime's, in the release namespace
    assert role["metadata"]["namespace"] == "ws-system" and rules_of(role) == RUNTIME_RULES
    sas = {(d["metadata"]["name"], d["metadata"]["namespace"]) for d in by_kind(docs, "ServiceAccount")}
    assert sas == {("ws-weightsync-operator", "ws-system"), ("weightsync-runtime", "ws-system")}
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] + container["args"][:4] == [
        "kopf",
        "run",
        "-m",
        "weightsync_operator",
        "--standalone",
    ]
    assert "--all-namespaces" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WEIGHTSYNC_RUNTIME_IMAGE"] == "ghcr.io/weightsync/weightsync:0.1.0"
    assert (
        env["WEIGHTSYNC_RUNTIME_SERVICE_ACCOUNT"] == "weightsync-runtime"
        and env["WEIGHTSYNC_METRICS_PORT"] == "8080"
        and env["WEIGHTSYNC_BIND_ADDRESS"] == "$(POD_IP)"  # the pod IP, not every interface
    )
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert "--liveness=http://$(POD_IP):8081/healthz" in container["args"]
    assert env["WEIGHTSYNC_RUNTIME_ALLOWED_IMAGES"] == ""  # only the default runtime image
    assert env["WEIGHTSYNC_RUNTIME_ALLOWED_ENV_SOURCES"] == "fieldRef,resourceFieldRef"
    assert env["WEIGHTSYNC_RUNTIME_DENIED_ENV_PREFIXES"] == "KUBERNETES_,LD_,PYTHON,WEIGHTSYNC_"
    assert {"name": "metrics", "containerPort": 8080} in container["ports"]
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    assert by_kind(docs, "Service") == []


def test_single_namespace_mode_has_nothing_cluster_scoped(helm: str) -> None:
    docs = render(helm, "watchNamespace=team-a", "metrics.service.enabled=true")
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    roles = {d["metadata"]["name"]: d for d in by_kind(docs, "Role")}
    assert roles["ws-weightsync-operator"]["metadata"]["namespace"] == "team-a"
    assert rules_of(roles["ws-weightsync-operator"]) == OPERATOR_RULES
    assert roles["weightsync-runtime"]["metadata"]["namespace"] == "team-a"
    assert rules_of(roles["weightsync-runtime"]) == RUNTIME_RULES
    binding = next(
        b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == "ws-weightsync-operator"
    )
    assert binding["metadata"]["namespace"] == "team-a" and binding["subjects"][0]["namespace"] == "ws-system"
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args
    (svc,) = by_kind(docs, "Service")
    assert svc["spec"]["ports"][0]["port"] == 8080


def test_runtime_namespaces_and_test_overrides(helm: str) -> None:
    docs = render(
        helm,
        "runtime.namespaces={a,b}",
        "operator.command={/venv/bin/kopf}",
        "operator.env[0].name=KUBECONFIG",
        "operator.env[0].value=/kc",
        "runtime.env[0].name=PATH",
        "runtime.env[0].value=/venv/bin",
        "operator.healthPort=0",
    )
    runtime_ns = {d["metadata"]["namespace"] for d in by_kind(docs, "Role")}
    assert runtime_ns == {"a", "b"}
    container = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/venv/bin/kopf"] and "livenessProbe" not in container
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (
        env["KUBECONFIG"] == "/kc"
        and env["WEIGHTSYNC_RUNTIME_ENV"] == '[{"name":"PATH","value":"/venv/bin"}]'
    )


@pytest.mark.parametrize(
    "sets", [(), ("watchNamespace=team-a",), ("runtime.namespaces={a,b}", "networkPolicy.enabled=true")]
)
def test_no_wildcard_verbs_or_resources(helm: str, sets: tuple[str, ...]) -> None:
    """Every permission the chart grants is named: no '*' verb, resource, API group or name."""
    docs = render(helm, *sets)
    roles = by_kind(docs, "Role") + by_kind(docs, "ClusterRole")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for key in ("verbs", "resources", "apiGroups", "resourceNames", "nonResourceURLs"):
                assert not any("*" in v for v in rule.get(key, [])), (role["metadata"]["name"], rule)
    for binding in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        assert binding["roleRef"]["name"] not in ("cluster-admin", "admin", "edit"), binding


def test_runtime_status_policy_pins_the_token_to_its_weightsync(helm: str) -> None:
    docs = render(helm)
    (vap,) = by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    assert vap["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["weightsyncs/status"]
    (cond,) = vap["spec"]["matchConditions"]
    assert cond["expression"].endswith("':weightsync-runtime'")
    (rule,) = vap["spec"]["validations"]
    assert (
        "object.metadata.name + '-runtime'" in rule["expression"] and vap["spec"]["failurePolicy"] == "Fail"
    )
    assert by_kind(render(helm, "runtime.statusPolicy.enabled=false"), "ValidatingAdmissionPolicy") == []


def test_network_policy_is_off_by_default_and_admits_members_only(helm: str) -> None:
    assert by_kind(render(helm), "NetworkPolicy") == []
    docs = render(helm, "networkPolicy.enabled=true", "runtime.namespaces={a,b}")
    policies = by_kind(docs, "NetworkPolicy")
    assert {p["metadata"]["namespace"] for p in policies} == {"a", "b"}
    spec = policies[0]["spec"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "weightsync-runtime"}}
    assert spec["policyTypes"] == ["Ingress"]
    (ingress,) = spec["ingress"]
    participants, operator = ingress["from"]
    assert participants == {"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ws-system"}}
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "weightsync-operator"


def value_lines(lines: list[str]) -> dict[str, int]:
    """Dotted key path -> line index, from indentation (values.yaml uses block style for keys)."""
    out, stack = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w]*):", line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        out[".".join(k for _, k in stack)] = i
    return out


def comment_above(lines: list[str], idx: int) -> str:
    block = []
    while idx > 0 and lines[idx - 1].strip().startswith("#"):
        idx -= 1
        block.append(lines[idx].strip())
    return "\n".join(reversed(block))


def test_every_value_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    values = yaml.safe_load("\n".join(lines))
    where = value_lines(lines)

    def leaves(node: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in node.items():
            if (
                isinstance(value, dict)
                and value
                and key not in ("resources", "podSecurityContext", "securityContext")
            ):
                out += leaves(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}")
        return out

    documented = [leaf for leaf in leaves(values) if comment_above(lines, where[leaf]).startswith("# --")]
    assert documented == leaves(values)
