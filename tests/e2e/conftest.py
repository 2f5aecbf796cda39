"""Fixtures for end-to-end tests against a real control plane on loopback.

``control_plane``: etcd + kube-apiserver + kube-controller-manager (``tests/k8s/controlplane.py``),
binaries from ``tests/k8s/ensure_binaries.sh`` (cached outside the clone; built on first use).
``node_agent``: the test-only kubelet (``tests/k8s/node_agent.py``) as a subprocess, with the
directory of ``sys.executable`` first on PATH so the project's console scripts resolve.
``kubectl`` / ``helm``: callables running the real binaries with the admin kubeconfig.
``namespace``: a fresh namespace per test.
``ray_cluster``: a local Ray head with token authentication (``tests/e2e/ray_cluster.py``).
At the end of the run the terminal summary says how long the e2e tests took (wall time from the
first e2e setup to the last teardown, and the sum of their phases).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

K8S_DIR = Path(__file__).resolve().parents[1] / "k8s"
REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(K8S_DIR))

from controlplane import ControlPlane, ensure_binaries  # noqa: E402
from node_agent import pod_logs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import say as _say  # noqa: E402
from ray_cluster import RayCluster  # noqa: E402


@pytest.fixture(scope="session")
def k8s_bin_dir(pytestconfig: pytest.Config) -> Path:
    t0 = time.monotonic()
    bin_dir = ensure_binaries(lambda line: _say(pytestconfig, line))
    _say(pytestconfig, f"k8s binaries ready in {time.monotonic() - t0:.1f}s: {bin_dir}")
    return bin_dir


@pytest.fixture(scope="session")
def control_plane(k8s_bin_dir: Path, pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    t0 = time.monotonic()
    with ControlPlane(k8s_bin_dir) as cp:
        _say(pytestconfig, f"control plane ready in {time.monotonic() - t0:.1f}s at {cp.server}")
        yield cp


class NodeAgentProcess:
    """Handle on the node agent subprocess."""

    def __init__(
        self, cp: ControlPlane, node_name: str, path_prefix: str, extra_args: Sequence[str] = ()
    ) -> None:
        self.node_name = node_name
        # Not under /tmp: pods (the chart's operator, runtime pods) mount an emptyDir on /tmp, which
        # would hide the agent's volume sources from the mounts that follow it in the pod's namespace.
        scratch = "/var/tmp" if os.path.isdir("/var/tmp") else None
        self.workdir = Path(tempfile.mkdtemp(prefix="ws-node-agent-", dir=scratch))
        self.log_path = self.workdir / "agent.log"
        cmd = [
            sys.executable,
            str(K8S_DIR / "node_agent.py"),
            "--kubeconfig",
            str(cp.kubeconfig),
            "--node-name",
            node_name,
            "--path-prefix",
            path_prefix,
            "--workdir",
            str(self.workdir / "pods"),
            # What the image would contain: this checkout (editable install) and the venv.
            "--image-path",
            str(REPO_ROOT),
            "--image-path",
            sys.prefix,
            *extra_args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while "ready" not in self.agent_log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.agent_log()
                self.stop()
                raise RuntimeError(f"node agent failed to start:\n{log}")
            time.sleep(0.1)

    def agent_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """Container logs of a pod the agent ran (like ``kubectl logs``)."""
        return pod_logs(self.workdir / "pods", namespace, pod, container)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def node_agent(control_plane: ControlPlane, pytestconfig: pytest.Config) -> Iterator[Any]:
    t0 = time.monotonic()
    agent = NodeAgentProcess(control_plane, "node-0", os.path.dirname(sys.executable))
    _say(pytestconfig, f"node agent ready in {time.monotonic() - t0:.1f}s ({agent.workdir})")
    try:
        yield agent
    finally:
        agent.stop()


@pytest.fixture
def start_node_agent(control_plane: ControlPlane) -> Iterator[Callable[..., NodeAgentProcess]]:
    """Factory for extra node agents (``start_node_agent("node-x", "--no-mount-ns")``),
    stopped after the test."""
    agents: list[NodeAgentProcess] = []

    def start(node_name: str, *extra_args: str) -> NodeAgentProcess:
        agents.append(NodeAgentProcess(control_plane, node_name, os.path.dirname(sys.executable), extra_args))
        return agents[-1]

    yield start
    for agent in agents:
        agent.stop()


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Callable[..., subprocess.CompletedProcess[str]]:
    return control_plane.kubectl


@pytest.fixture(scope="session")
def helm(control_plane: ControlPlane) -> Callable[..., subprocess.CompletedProcess[str]]:
    return control_plane.helm


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"t-{request.node.name[:40].lower().replace('_', '-')}-{uuid.uuid4().hex[:5]}"
    name = "".join(ch for ch in name if ch.isalnum() or ch == "-").strip("-")
    control_plane.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30  # pods need the `default` ServiceAccount
    while control_plane.kubectl("get", "sa", "default", "-n", name, check=False).returncode:
        assert time.monotonic() < deadline, "no default ServiceAccount in new namespace"
        time.sleep(0.2)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def ray_cluster(pytestconfig: pytest.Config) -> Iterator[RayCluster]:
    """``ray start --head`` with RAY_AUTH_MODE=token on 127.0.0.1; its processes killed by pid at the end."""
    t0 = time.monotonic()
    cluster = RayCluster(os.path.dirname(sys.executable), num_cpus=2).start()
    _say(pytestconfig, f"ray cluster (token auth) ready in {time.monotonic() - t0:.1f}s at {cluster.address}")
    try:
        yield cluster
    finally:
        cluster.stop()


class _E2ETimer:
    """Wall time of the e2e tests, reported in the terminal summary."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.phases = 0.0
        self.count = 0

    def add(self, report: pytest.TestReport) -> None:
        if "e2e" not in report.keywords:
            return
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if start is not None and stop is not None:
            self.first = start if self.first is None else min(self.first, start)
            self.last = stop if self.last is None else max(self.last, stop)
        self.phases += report.duration
        self.count += report.when == "call"


_TIMER = _E2ETimer()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _TIMER.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _TIMER.first is None or _TIMER.last is None:
        return
    terminalreporter.write_line(
        f"e2e suite: {_TIMER.count} tests, wall {_TIMER.last - _TIMER.first:.1f}s "
        f"(setup+call+teardown {_TIMER.phases:.1f}s)"
    )
