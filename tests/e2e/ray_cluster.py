"""A local Ray cluster with token authentication for the end-to-end tests, and a small driver CLI.

``RayCluster`` runs ``ray start --head --block`` with ``RAY_AUTH_MODE=token`` and a random
``RAY_AUTH_TOKEN`` (Ray reads the token from that variable first; every client must present it),
on a free loopback port, with its own temp dir outside ``/tmp`` (pods run by the node agent get an
emptyDir mounted on ``/tmp``, and a Ray driver needs the session's socket files). ``ray stop`` is
never used: it kills every Ray process on the machine, other test runs' included. Each process the
cluster starts inherits a marker variable (``WS_E2E_RAY=<id>``), and ``stop()`` kills exactly the
processes carrying it, by pid.

What the tests do in the cluster runs in ``ray_driver.py`` (a driver process with the cluster's
``env()``): ``driver(...)`` sends one command to a long-lived ``ray_driver.py serve`` process
(started on first use, one per cluster), ``driver_popen(...)`` runs one command in its own
process (a call that must stay in flight while the test does something else).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sync_runtime.testing.cluster import RAYLET_TIMEOUT
from sync_runtime.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "ray_driver.py"
REPLY = "@ws-driver "
"""Prefix of ray_driver.py's answer lines (its REPLY)."""
MARKER = "WS_E2E_RAY"
RAY_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", MARKER)


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
        self._fresh_place()
        self.proc: subprocess.Popen[bytes] | None = None
        self._driver: DriverServer | None = None

    def _fresh_place(self) -> None:
        """A new temp dir and port (each `ray start` attempt gets its own)."""
        base = "/var/tmp" if os.path.isdir("/var/tmp") else None
        self.temp_dir = Path(tempfile.mkdtemp(prefix="wsray-", dir=base))
        self.log_path = self.temp_dir / "ray-start.log"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

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

    def start(self, attempts: int = 3) -> RayCluster:
        """`ray start --head`, again (new port and temp dir) when Ray gave up waiting for its
        own raylet: Ray 2.60 allows a fixed 30 s for the raylet to register with the GCS
        (ray/_private/node.py), which a 2-core machine running another test lane can exceed."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except RuntimeError as e:
                if attempt == attempts or RAYLET_TIMEOUT not in str(e):
                    raise
                print(f"ray start: raylet not registered in time (attempt {attempt}); again", flush=True)
                self._fresh_place()
        raise AssertionError("unreachable")

    def _start_once(self) -> RayCluster:
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
        """One ``ray_driver.py`` command (argv ``args``) through this cluster's long-lived driver;
        returns the command's JSON result (None when it failed and ``check`` is false)."""
        if self._driver is None or not self._driver.alive():
            self._driver = DriverServer(self)
        return self._driver.call([*args, "--address", self.address], timeout, check)

    def driver_popen(self, *args: str) -> subprocess.Popen[str]:
        """One command in its own driver process, left running (stdout: its lines, then its JSON)."""
        return subprocess.Popen(
            [sys.executable, str(DRIVER), *args, "--address", self.address],
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def stop(self) -> None:
        """Kill the head and everything it started (marked processes only), remove the temp dir."""
        if self._driver is not None:
            self._driver.close()
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


class DriverServer:
    """A ``ray_driver.py serve`` process: commands as JSON lines on its stdin, one answer line each.
    A command that does not answer in time kills the process (the next call starts a new one)."""

    def __init__(self, cluster: RayCluster) -> None:
        self.log_path = cluster.temp_dir / f"driver-{secrets.token_hex(3)}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(DRIVER), "serve", "--address", cluster.address],
                env=cluster.env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO,
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self.lines.put(line[len(REPLY) :])
        self.lines.put(None)  # EOF: the process is gone

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, argv: list[str], timeout: float, check: bool) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise AssertionError(f"driver {argv[0]}: no answer within {timeout:g}s\n{self._log()}") from None
        if line is None:
            raise AssertionError(f"driver exited ({self.proc.wait()}) during {argv[0]}\n{self._log()}")
        answer = json.loads(line)
        if not answer["ok"]:
            if check:
                raise AssertionError(f"driver {' '.join(argv[:3])}... failed:\n{answer['error']}")
            return None
        return answer["out"]

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF: serve returns
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
