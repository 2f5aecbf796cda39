"""The chart's NetworkPolicy for the `vllm serve` pods of vllmServers destinations (real helm).

Their port serves vLLM's development routes next to /v1/*: the policy admits the runtime pods
(that port), the participants (every port: the proxies driving the servers, the sync's process
group) and only the listed clients (that port). Off by default; refuses to render without a
selector (an empty one would select every pod of the namespace).
"""

from __future__ import annotations

import subprocess

import pytest
from test_chart import CHART, by_kind, find_helm, render

pytestmark = pytest.mark.e2e

ON = ("networkPolicy.vllmServers.enabled=true", "networkPolicy.vllmServers.podSelector.matchLabels.app=vllm")


@pytest.fixture(scope="module")
def helm() -> str:
    path = find_helm()
    if path is None:  # a chart test never passes by skipping
        pytest.fail("helm not found: run tests/k8s/ensure_binaries.sh (make test does)")
    return path


def _servers_policy(docs: list[dict]) -> list[dict]:
    return [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-vllm-servers")]


def test_off_by_default_and_refused_without_a_selector(helm: str) -> None:
    assert _servers_policy(render(helm)) == []
    proc = subprocess.run(
        [helm, "template", "ws", str(CHART), "--set", "networkPolicy.vllmServers.enabled=true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "podSelector must select the vLLM server pods" in proc.stderr


def test_only_weightsync_and_listed_clients_reach_the_servers(helm: str) -> None:
    (policy,) = _servers_policy(render(helm, *ON, "runtime.namespaces={team-a}"))
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == "team-a"
    assert spec["podSelector"] == {"matchLabels": {"app": "vllm"}} and spec["policyTypes"] == ["Ingress"]
    runtime, participants = spec["ingress"]  # no clients listed: no third rule (an empty `from` admits all)
    assert runtime["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "weightsync-runtime"}}}
    ]
    assert runtime["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert participants == {"from": [{"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}]}
    gateway = "networkPolicy.vllmServers.clients[0].podSelector.matchLabels.app=gateway"
    (policy,) = _servers_policy(render(helm, *ON, gateway, "networkPolicy.vllmServers.port=9000"))
    clients = policy["spec"]["ingress"][2]
    assert clients == {
        "from": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
        "ports": [{"port": 9000, "protocol": "TCP"}],
    }


def test_the_runtime_policy_admits_the_servers_workers(helm: str) -> None:
    docs = render(helm, *ON, "networkPolicy.enabled=true")
    (runtime,) = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-runtime")]
    peers = runtime["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app": "vllm"}}} in peers
    docs = render(helm, "networkPolicy.enabled=true")  # no vllmServers policy: the runtime's is as before
    (runtime,) = by_kind(docs, "NetworkPolicy")
    assert len(runtime["spec"]["ingress"][0]["from"]) == 2
