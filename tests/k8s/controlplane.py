"""A real Kubernetes control plane on loopback, for tests (no Docker, no kubelet).

``ControlPlane`` generates a throw-away PKI with the ``openssl`` CLI, then starts etcd,
kube-apiserver and kube-controller-manager (binaries from ``tests/k8s/ensure_binaries.sh``) on
free 127.0.0.1 ports, writes an admin kubeconfig and waits until the apiserver is ready.
Everything lives in one temporary directory that is removed on ``stop()``; every process runs
in its own process group, which ``stop()`` kills, also when startup fails half-way.

    with ControlPlane(bin_dir) as cp:
        cp.kubectl("get", "ns")
        cp.helm("version")

Pods are not run by this module; see ``node_agent.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sync_runtime.testing.ports import free_port

HERE = Path(__file__).resolve().parent
ENSURE_BINARIES = HERE / "ensure_binaries.sh"

DEFAULT_CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "job-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",  # fills admin/edit/view from aggregate-to-* roles
    "ttl-after-finished-controller",
)
SERVICE_CIDR = "10.0.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


def ensure_binaries(say: Callable[[str], None] = print) -> Path:
    """Run ensure_binaries.sh (builds on a cache miss) and return the bin directory."""
    proc = subprocess.run(["bash", str(ENSURE_BINARIES)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ensure_binaries.sh failed:\n{proc.stderr}\n{proc.stdout}")
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1]:
        say(line)
    return Path(lines[-1])


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr}")


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager on 127.0.0.1.

    Attributes after ``start()``: ``server`` (https URL), ``kubeconfig`` (admin, system:masters),
    ``ca_path``, ``port`` (apiserver secure port), ``workdir``, ``log_dir``.
    """

    def __init__(
        self,
        bin_dir: Path | str,
        *,
        controllers: Sequence[str] = DEFAULT_CONTROLLERS,
        startup_timeout: float = 90.0,
        keep_workdir: bool = False,
    ) -> None:
        self.bin_dir = Path(bin_dir)
        self.controllers = tuple(controllers)
        self.startup_timeout = startup_timeout
        self.keep_workdir = keep_workdir
        self.workdir = Path(tempfile.mkdtemp(prefix="ws-controlplane-"))
        self.pki = self.workdir / "pki"
        self.log_dir = self.workdir / "logs"
        self.ca_path = self.pki / "ca.crt"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.port = 0
        self.server = ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.pki.mkdir(parents=True)
        self.log_dir.mkdir()
        self._make_pki()
        etcd_client, etcd_peer = free_port(), free_port()
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self._write_kubeconfig(self.kubeconfig, "admin")
        self._write_kubeconfig(self.workdir / "kcm.kubeconfig", "kcm")
        deadline = time.monotonic() + self.startup_timeout

        self._spawn(
            "etcd",
            [
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait(deadline, "etcd", lambda: self._get(f"http://127.0.0.1:{etcd_client}/health"))

        p = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={p}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={self.ca_path}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Endpoints may not point at loopback, so don't reconcile the `kubernetes` service.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait(deadline, "kube-apiserver", lambda: self._get(f"{self.server}/readyz"))

        kcm_port = free_port()
        kcm_kc = self.workdir / "kcm.kubeconfig"
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                f"--controllers={','.join(self.controllers)}",
                f"--service-account-private-key-file={p / 'sa.key'}",
                f"--root-ca-file={self.ca_path}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={self.workdir / 'kcm-certs'}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait(
            deadline,
            "kube-controller-manager",
            lambda: self._get(f"https://127.0.0.1:{kcm_port}/healthz", verify=False),
        )
        # Pods need the namespace's `default` ServiceAccount (created by the controller manager).
        self._wait(
            deadline,
            "default ServiceAccount",
            lambda: self._get(f"{self.server}/api/v1/namespaces/default/serviceaccounts/default"),
        )

    def stop(self) -> None:
        """Kill every process group (controller manager first, etcd last); remove the temp dir."""
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            _kill_group(proc)
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---------------------------------------------------------------- helpers for tests
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self._run_tool("kubectl", args, check, input, timeout)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run_tool("helm", args, check, input, timeout)

    def get_json(self, path: str) -> Any:
        """GET an API path (e.g. ``/version``) as the admin user."""
        # 30 s, not the readiness probe's 5: on CI's two cores, beside the engine lane, one TLS
        # handshake with a busy apiserver took over 5 s (a CI-equivalent run at dd3270b)
        with self._open(f"{self.server}{path}", timeout_s=30) as resp:
            return json.loads(resp.read())

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for the admin kubeconfig."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def log(self, component: str) -> str:
        return (self.log_dir / f"{component}.log").read_text(errors="replace")

    # ---------------------------------------------------------------- internals
    def _run_tool(
        self, tool: str, args: Sequence[str], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / tool), *args]
        env = self.env()
        if tool == "helm":  # keep helm's state out of $HOME
            for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config")):
                env[var] = str(self.workdir / "helm" / sub)
            env["HELM_DATA_HOME"] = str(self.workdir / "helm" / "data")
        proc = subprocess.run(cmd, env=env, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, output=proc.stdout, stderr=proc.stderr)
        return proc

    def _make_pki(self) -> None:
        d = self.pki
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl(
            "req",
            "-x509",
            *ec,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "7",
            "-subj",
            "/CN=weightsync-test-ca",
            cwd=d,
        )
        sans = [
            "IP:127.0.0.1",
            "IP:10.0.0.1",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
        certs = {
            "apiserver": ("/CN=kube-apiserver", "serverAuth", "subjectAltName=" + ",".join(sans)),
            "admin": ("/O=system:masters/CN=admin", "clientAuth", None),
            "kcm": ("/CN=system:kube-controller-manager", "clientAuth", None),
        }
        for name, (subj, eku, san) in certs.items():
            _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj, cwd=d)
            ext = f"keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={eku}\n"
            if san:
                ext += san + "\n"
            (d / f"{name}.ext").write_text(ext)
            _openssl(
                "x509",
                "-req",
                "-in",
                f"{name}.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "7",
                "-out",
                f"{name}.crt",
                "-extfile",
                f"{name}.ext",
                cwd=d,
            )
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=d)
        _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)

    def _write_kubeconfig(self, path: Path, user: str) -> None:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_path)},
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate": str(self.pki / f"{user}.crt"),
                        "client-key": str(self.pki / f"{user}.key"),
                    },
                }
            ],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }
        path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
        path.chmod(0o600)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        try:
            self.procs[name] = subprocess.Popen(
                [str(self.bin_dir / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.workdir,
            )
        finally:
            log.close()

    def _ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        if not verify:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _open(self, url: str, verify: bool = True, timeout_s: float = 5) -> Any:
        ctx = self._ssl_context(verify) if url.startswith("https") else None
        return urllib.request.urlopen(url, timeout=timeout_s, context=ctx)

    def _get(self, url: str, verify: bool = True) -> bool:
        try:
            with self._open(url, verify) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    def _wait(self, deadline: float, what: str, ready: Any) -> None:
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = self.log(name)[-3000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            if ready():
                return
            time.sleep(0.2)
        logs = "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.procs)
        raise TimeoutError(f"{what} not ready after {self.startup_timeout}s\n{logs}")


def _kill_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):  # also reap anything left in the group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
