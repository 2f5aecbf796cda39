"""A local Ray cluster with token authentication for the end-to-end tests, and a small driver CLI.

``RayCluster`` runs ``ray start --head --block`` with ``RAY_AUTH_MODE=token`` and a random
``RAY_AUTH_TOKEN`` (Ray reads the token from that variable first; every client must present it),
on a free loopback port, with its own temp dir outside ``/tmp`` (pods run by the node agent get an
emptyDir mounted on ``/tmp``, and a Ray driver needs the session's socket files). ``ray stop`` is
never used: it kills every Ray process on the machine, other test runs' included. Each process the
cluster starts inherits a marker variable (``WS_E2E_RAY=<id>``), and ``stop()`` kills exactly the
processes carrying it, by pid.

The same file is the tests' driver for what the demo CLI does not offer (run with the cluster's
``env()``; each subcommand connects with the token, acts, prints one JSON line and exits):

    python ray_cluster.py gate --namespace NS --prefix P --gate-file F   # arm a gate on actors
    python ray_cluster.py kill --namespace NS --name ACTOR               # ray.kill one actor
    python ray_cluster.py snapshot --namespace NS --prefix P --model M --dst SPEC --seed S

``gate``: each matching actor's transfer engine waits before every round while file F exists
(the engine's ``before_round`` test observer, set as the participant's ``_ws_hooks`` with
``__ray_call__``, so the demo's own participant classes are used unchanged); a rank that
reaches a closed gate touches ``F.<pid>.reached``, so a test knows the transfer is under way
without relying on progress reports.
``snapshot``: submits one call per destination actor that returns its version and tensor
checksums in the same task, prints ``submitted``, then compares every rank bit-exact with the
seeded weights of the version it reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MARKER = "WS_E2E_RAY"
RAY_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", MARKER)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _marked_pids(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``WS_E2E_RAY=<marker>`` (ours only)."""
    want = f"{MARKER}={marker}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if want in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


class RayCluster:
    """``ray start --head`` with token auth; ``address`` is ``127.0.0.1:<port>``."""

    def __init__(self, bin_dir: Path | str, *, num_cpus: int = 2, startup_timeout: float = 120.0) -> None:
        self.bin_dir = Path(bin_dir)
        self.num_cpus = num_cpus
        self.startup_timeout = startup_timeout
        self.token = secrets.token_hex(24)
        self.marker = secrets.token_hex(6)
        base = "/var/tmp" if os.path.isdir("/var/tmp") else None
        self.temp_dir = Path(tempfile.mkdtemp(prefix="wsray-", dir=base))
        self.log_path = self.temp_dir / "ray-start.log"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self, **extra: str) -> dict[str, str]:
        """Environment of a client of this cluster (token included), derived from ours."""
        env = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
        pythonpath = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONPATH=pythonpath,
            PATH=os.pathsep.join([str(self.bin_dir), env.get("PATH", "")]),
            **{MARKER: self.marker},
        )
        env.update(extra)
        return env

    def start(self) -> RayCluster:
        cmd = [
            str(self.bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.num_cpus}",
            "--include-dashboard=false",
            "--dashboard-host=127.0.0.1",
            "--disable-usage-stats",
            f"--object-store-memory={128 << 20}",
            f"--temp-dir={self.temp_dir}",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while "Ray runtime started" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log()
                self.stop()
                raise RuntimeError(f"ray start failed:\n{text[-4000:]}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def run(self, *args: str, timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command (e.g. ``weightsync demo ...``) as a client of this cluster."""
        proc = subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args[:4])}... exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
            )
        return proc

    def driver(self, *args: str, timeout: float = 180.0, check: bool = True) -> Any:
        """Run a subcommand of this file's driver CLI; returns its last stdout line as JSON."""
        proc = self.run(
            sys.executable, __file__, *args, "--address", self.address, timeout=timeout, check=check
        )
        lines = proc.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else None

    def driver_popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, __file__, *args, "--address", self.address],
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def stop(self) -> None:
        """Kill the head and everything it started (marked processes only), remove the temp dir."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        for _ in range(3):
            pids = _marked_pids(self.marker)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- driver CLI (runs in a subprocess with the cluster's env) -------------------------------------


def _actors(namespace: str, prefix: str) -> list[tuple[str, Any]]:
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    names = sorted(a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith(prefix))
    return [(n, ray.get_actor(n, namespace=namespace)) for n in names]


def _install_gate(actor: Any, gate_file: str, max_wait_s: float) -> bool:
    from sync_runtime.transfer import EngineHooks

    def gate(_round: int) -> None:
        if not os.path.exists(gate_file):
            return
        Path(f"{gate_file}.{os.getpid()}.reached").touch()  # tells the test this rank is mid-transfer
        deadline = time.monotonic() + max_wait_s
        while os.path.exists(gate_file) and time.monotonic() < deadline:
            time.sleep(0.05)

    actor._ws_hooks = EngineHooks(before_round=gate)  # what the participant's ws_run hands its engine
    return True


def _arm_corruption(actor: Any, armed: bool) -> bool:
    """Flip one staged byte right before this rank's commit applies it (after the decision): the
    rank's check of its staging refuses the commit, so its replica ends on two versions."""
    from sync_runtime.testing.faults import flip_first_staged_byte

    actor._ws_before_commit = flip_first_staged_byte if armed else None  # pre-commit observer
    return True


def _state(actor: Any) -> tuple[str | None, dict[str, str], Any]:
    return actor.ws_version(), actor.ws_sha256(), actor.ws_meta().coord


def cmd_gate(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    actors = _actors(args.namespace, args.prefix)
    ray.get([h.__ray_call__.remote(_install_gate, args.gate_file, args.max_wait) for _, h in actors])
    return {"gated": [n for n, _ in actors]}


def cmd_kill(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    ray.kill(ray.get_actor(args.name, namespace=args.namespace), no_restart=True)
    return {"killed": args.name}


def cmd_corrupt(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    actor = ray.get_actor(args.name, namespace=args.namespace)
    ray.get(actor.__ray_call__.remote(_arm_corruption, args.armed == "on"))
    return {"corrupt": args.name, "armed": args.armed}


def cmd_snapshot(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from sync_runtime.core.models import build_manifest
    from sync_runtime.core.topology import ParallelSpec
    from sync_runtime.testing.weights import expected_sha256, model_config

    actors = _actors(args.namespace, args.prefix)
    refs = {n: h.__ray_call__.remote(_state) for n, h in actors}
    print("submitted", flush=True)
    manifest = build_manifest(model_config(args.model))
    spec = ParallelSpec.parse(args.dst)
    ranks: dict[str, Any] = {}
    for name, ref in refs.items():
        try:
            version, sums, coord = ray.get(ref, timeout=args.timeout)
        except ray.exceptions.RayActorError as e:
            ranks[name] = {"dead": True, "error": type(e).__name__}
            continue
        want = expected_sha256(manifest, "vllm", spec, coord, args.seed, version)
        ranks[name] = {"version": version, "exact": want == sums, "tensors": len(sums)}
    return {"ranks": ranks}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray_cluster.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("gate", "kill", "corrupt", "snapshot"):
        p = sub.add_parser(name)
        p.add_argument("--address", required=True)
        p.add_argument("--namespace", required=True)
    gate = sub.choices["gate"]
    gate.add_argument("--prefix", required=True)
    gate.add_argument("--gate-file", required=True)
    gate.add_argument("--max-wait", type=float, default=50.0)
    sub.choices["kill"].add_argument("--name", required=True)
    sub.choices["corrupt"].add_argument("--name", required=True)
    sub.choices["corrupt"].add_argument("--armed", choices=("on", "off"), required=True)
    snap = sub.choices["snapshot"]
    snap.add_argument("--prefix", required=True)
    snap.add_argument("--model", required=True)
    snap.add_argument("--dst", required=True)
    snap.add_argument("--seed", type=int, default=0)
    snap.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)

    import ray

    ray.init(address=args.address, namespace=args.namespace, logging_level="WARNING", log_to_driver=False)
    commands = {"gate": cmd_gate, "kill": cmd_kill, "corrupt": cmd_corrupt, "snapshot": cmd_snapshot}
    out = commands[args.cmd](args)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
