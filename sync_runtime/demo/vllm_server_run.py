"""`weightsync demo --engine vllm-server`: two syncs into real `vllm serve` servers while a client
keeps sending them requests, judged by what they generate.

Each destination replica is a `vllm serve` process (TP from --dst) started with dummy weights and
`--weight-transfer-config '{"backend": "weightsync"}'` (the backend is the plugin of the installed
package), attached as a destination through the public path, `attach(name, namespace,
HttpControl(url), ...)`; the reference is one more `vllm serve`, without the backend, loaded by
vLLM's own loader from reference.safetensors. The sources are the demo's Megatron-layout actors:
they hold version v0 (the first sync), then train a step to v1, the reference's weights (the
second sync, on the warm path). Generation goes through `/v1/completions` (prompt token ids,
temperature 0, the chosen tokens' logprobs), one prompt per request with no other request in the
engine. Between the generations before and after, one client per replica sends requests (every
other one through `/inference/v1/generate`, whose answers carry vLLM's weight versions) from
before the first sync until each has finished a request on the final version.

Exit 0 only when every replica's generation after the syncs equals the reference server's bit
for bit (token ids and logprobs), its dummy-weight generation differs on every row, the bytes each
rank applied are its layout shard, no client request failed and at least one was in flight during
a sync; otherwise exit 1 with one line naming the failed checks. The dump is the `--engine vllm`
demo's plus serving.json and the servers' logs (server-logs/). With WEIGHTSYNC_REFERENCE_CACHE=1
the reference server's answers come from the reference cache when it holds them for exactly this
server (sync_runtime/testing/vllm_oracle_keys.py; the tests set it): no reference server starts
then, and a line says so. Servers run in their own process
groups and are stopped on every exit (SIGTERM to the demo included).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from sync_runtime.core.topology import ParallelSpec, Role
from sync_runtime.demo.console import ConsoleReporter, human_bytes, ranks_table, summary_table
from sync_runtime.demo.vllm_run import (
    VERSION,
    Outcome,
    applied_checksums,
    generation_table,
    reference_setup,
    write_outcomes,
)
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncReport, SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    kill_participants,
    start_local_ray,
    train_step,
    weightsync_spec,
)
from sync_runtime.testing.vllm_deploy import Generation, token_rows_equal
from sync_runtime.testing.vllm_models import PROMPTS, vllm_model_config
from sync_runtime.testing.vllm_oracle_keys import DemoOracle, server_oracle_key
from sync_runtime.testing.vllm_server import Client, Server, completions, generate, launch, stop

FIRST = "v0"
"""The first sync's version; the second is VERSION (v1), the reference checkpoint's."""
SETTLE_TIMEOUT_S = 120.0
CLIENT_INTERVAL_S = 0.5
"""Seconds each serving client waits between two requests."""
WARMUPS = 1
"""Warm-up requests per server before any generation is kept (part of the oracle's key)."""
ENGINE_ENV_HINT = (
    'make demo ARGS="--engine vllm-server ..." (it runs in tools/vllm_env.sh\'s environment), or '
    "VE=$(bash tools/vllm_env.sh); $VE/bin/weightsync demo --engine vllm-server ..."
)


def refusal(args: argparse.Namespace, dst: ParallelSpec) -> str | None:
    """Why this run cannot be made (one line), or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"--engine vllm-server needs vLLM, which {sys.executable} cannot import. "
            f"Run it with {ENGINE_ENV_HINT}"
        )
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(ep.value.startswith("sync_runtime.engines.vllm_plugin") for ep in plugins):
        return (
            f"--engine vllm-server: the weightsync vLLM plugin is not installed in {sys.prefix} "
            "(pip install weightsync there: its vllm.general_plugins entry point registers the backend)"
        )
    if args.source != "synthetic" or args.ray_address or args.participants_only or args.train_step:
        return "--engine vllm-server runs synthetic sources on an embedded cluster only"
    if args.verify_only:
        return "--engine vllm-server runs synthetic sources on an embedded cluster only"
    if dst.pp != 1 or dst.ep != 1:
        return f"--dst {dst.describe()}: --engine vllm-server takes tp and replicas only"
    return None


@dataclass
class Fleet:
    """The demo's `vllm serve` processes and the WeightSync proxies attached to the replicas."""

    replicas: list[Server] = field(default_factory=list)
    reference: Server | None = None
    proxies: list[Any] = field(default_factory=list)
    oracle: DemoOracle = field(default_factory=lambda: DemoOracle(None, "off"))
    """Where the reference's answers come from: a cache hit starts no reference server."""

    def launch(self, model_dir: str, logs: Path, dst: ParallelSpec) -> None:
        """Every server boots in the background (one at a time they would take minutes longer)."""
        logs.mkdir(parents=True, exist_ok=True)
        self.oracle = DemoOracle.look_up(
            lambda: server_oracle_key(model_dir, tp=dst.tp, calls=2, warmups=WARMUPS)
        )
        for k in range(dst.replicas):
            self.replicas.append(launch(model_dir, logs / f"replica-{k}.log", tp=dst.tp))
        if not self.oracle.cached:
            self.reference = launch(
                model_dir, logs / "reference.log", tp=dst.tp, load_format="auto", backend=False
            )

    def attach(self, setup: DemoSetup) -> None:
        """Healthy servers; one proxy per replica (discovery finds it by the destination prefix);
        one warm-up request per server (a fresh server's first forward pass is slow)."""
        for k, server in enumerate(self.replicas):
            control = HttpControl(server.wait())
            name = f"{setup.dst_prefix}r{k}"
            self.proxies.append(attach(name, setup.namespace, control, replica=k, ranks=setup.dst.tp))
        ray.get([p.ws_num_ranks.remote() for p in self.proxies], timeout=600)
        for server in self.servers():
            for _ in range(WARMUPS):
                generate(server.wait(), PROMPTS[0], timeout_s=600)

    def servers(self) -> list[Server]:
        return [*self.replicas, *([self.reference] if self.reference else [])]

    def close(self) -> None:
        for p in self.proxies:
            with contextlib.suppress(Exception):
                ray.kill(p)
        for server in self.servers():
            stop(server.proc)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # unwinds through the finally blocks that stop the servers


def run_vllm_server_demo(args: argparse.Namespace, console: Console) -> int:
    config = vllm_model_config(args.model)
    dst = ParallelSpec.parse(args.dst)
    problem = refusal(args, dst)
    if problem is not None:
        console.print(f"[red]weightsync demo: {problem}[/]", highlight=False, soft_wrap=True)
        return 2
    work = args.dump or Path(tempfile.mkdtemp(prefix="weightsync-vllm-server-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    started, fleet = time.monotonic(), Fleet()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        model_dir, setup = reference_setup(args, config, dst, work)
        address = start_local_ray(namespace=setup.namespace)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        fleet.launch(model_dir, work / "server-logs", dst)
        return _deploy_and_check(setup, args, console, work, address, fleet, started)
    finally:
        fleet.close()
        signal.signal(signal.SIGTERM, previous)
        if ray.is_initialized():
            ray.shutdown()
        if args.dump is None:
            shutil.rmtree(work, ignore_errors=True)


def _deploy_and_check(
    setup: DemoSetup,
    args: argparse.Namespace,
    console: Console,
    work: Path,
    address: str,
    fleet: Fleet,
    started: float,
) -> int:
    console.print(
        f"[bold]WeightSync demo (vLLM servers)[/]: {setup.config['architectures'][0]} "
        f"({len(setup.manifest.tensors)} tensors, {human_bytes(setup.manifest.nbytes)} bf16), "
        f"megatron {setup.src.describe()} -> {setup.dst.replicas} `vllm serve` tp={setup.dst.tp}, "
        f"oracle: `vllm serve` loading {work / 'reference.safetensors'}"
    )
    try:
        create_participants(
            setup, src_version=FIRST, dst_version="-", skip=lambda c: c.role is Role.DESTINATION
        )
        fleet.attach(setup)
        console.print(
            f"  {setup.src.world_size} source actors and {len(fleet.servers())} vLLM servers ready "
            f"({time.monotonic() - started:.1f}s)"
        )
        ref = _reference_generation(fleet, console)
        outcomes = [Outcome(k, completions(s.url)) for k, s in enumerate(fleet.replicas)]
        # A request every half second or so per server: the load of a serving replica, while
        # leaving this machine's other processes (the sources, the sync itself) their share of it.
        clients = [Client(s.url, CLIENT_INTERVAL_S, completions=True) for s in fleet.replicas]
        reports, windows = _syncs(setup, args, console, address, clients)
        if all(r.result is SyncResult.SUCCEEDED for r in reports):
            for o, s in zip(outcomes, fleet.replicas, strict=True):
                o.after = completions(s.url)
            applied_checksums(setup, fleet.proxies, outcomes)
        serving = serving_summary(clients, windows, fleet.proxies)
        return _conclude(setup, args, console, work, reports, outcomes, ref, serving, started)
    finally:
        kill_participants(setup)


def _reference_generation(fleet: Fleet, console: Console) -> Generation:
    """The oracle's completions (twice: it must repeat itself), then its server is stopped; or
    both calls from the reference cache (no server was started)."""
    if fleet.oracle.runs is not None:
        runs = fleet.oracle.runs
    else:
        assert fleet.reference is not None
        runs = fleet.oracle.keep([completions(fleet.reference.url) for _ in range(2)])
        stop(fleet.reference.proc)  # its cores serve the replicas from here on
    console.print(f"  {fleet.oracle.line()}", soft_wrap=True, highlight=False)
    if runs[0] != runs[1]:
        console.print("  [yellow]the reference server did not repeat itself; comparing its 2nd call[/]")
    return runs[1]


def _syncs(
    setup: DemoSetup, args: argparse.Namespace, console: Console, address: str, clients: Sequence[Client]
) -> tuple[list[SyncReport], list[tuple[float, float]]]:
    """FIRST, then (sources trained a step) VERSION, with the clients sending throughout; the
    reports and each sync's (start, end) in time.monotonic() seconds."""
    spec = weightsync_spec(
        setup, FIRST, address=address, transport=Transport(transfer_timeout_seconds=args.timeout)
    )
    coordinator = Coordinator(spec, ConsoleReporter(console), manifest=setup.manifest)
    reports: list[SyncReport] = []
    windows: list[tuple[float, float]] = []
    for c in clients:
        c.start()
    try:
        for version in (FIRST, VERSION):
            if version != FIRST:
                train_step(setup, version)
                console.print(f"  sources trained a step: now {version}")
            _settle(clients)  # each client has served on the current weights before the sync
            begin = time.monotonic()
            reports.append(coordinator.sync(version))
            windows.append((begin, time.monotonic()))
            if reports[-1].result is not SyncResult.SUCCEEDED:
                break
        _settle(clients)  # a request on the final version (versions_seen shows it)
    finally:
        coordinator.close()
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(SETTLE_TIMEOUT_S)
    return reports, windows


def _settle(clients: Sequence[Client], requests: int = 2) -> None:
    """Wait until each client finished `requests` more requests (so one began after now)."""
    marks = [c.requests + requests for c in clients]
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline and any(c.requests < m for c, m in zip(clients, marks, strict=True)):
        time.sleep(0.05)


def serving_summary(
    clients: Sequence[Client], windows: Sequence[tuple[float, float]], proxies: Sequence[Any]
) -> dict[str, Any]:
    """serving.json: the clients' requests; `during_sync` counts those in flight while a sync
    ran (begun before it ended, finished after it began); `pause_seconds`, per replica, each
    apply's pause of generation; `versions_seen`, vLLM's weight version labels in the answers."""

    def in_sync(span: tuple[float, float]) -> bool:
        return any(span[0] < end and span[1] > begin for begin, end in windows)

    per_replica = [
        {
            "requests": c.requests,
            "failed": c.failed,
            "during_sync": sum(map(in_sync, c.spans)),
            "errors": c.errors[:5],
        }
        for c in clients
    ]
    return {
        "requests": sum(r["requests"] for r in per_replica),
        "failed": sum(r["failed"] for r in per_replica),
        "during_sync": sum(r["during_sync"] for r in per_replica),
        "pause_seconds": [ray.get(p.pause_seconds.remote(), timeout=60) for p in proxies],
        "versions_seen": sorted(set().union(*(c.versions for c in clients))),
        "sync_seconds": [round(end - begin, 3) for begin, end in windows],
        "replicas": per_replica,
    }


def failed_checks(
    reports: Sequence[SyncReport], outcomes: Sequence[Outcome], ref: Generation, serving: dict[str, Any]
) -> list[str]:
    """Every exit-0 condition that does not hold, one phrase each."""
    problems = [
        f"sync {r.version} {r.result.value}: {r.failure}"
        for r in reports
        if r.result is not SyncResult.SUCCEEDED
    ]
    n = len(ref)
    for o in outcomes:
        if not problems and not o.bit_identical(ref):
            same = sum(a == b for a, b in zip(o.after or [], ref, strict=False))
            problems.append(f"replica {o.replica} after the syncs: {same}/{n} rows equal the reference's")
        if not o.before_differs(ref):
            same = token_rows_equal(o.before, ref)
            problems.append(f"replica {o.replica} before the syncs (dummy weights): {same}/{n} rows equal")
        if not problems and not o.applied_ok():
            problems.append(f"replica {o.replica}: the bytes applied differ from its layout shard")
    if serving["failed"]:
        first = next((e for r in serving["replicas"] for e in r["errors"]), "no error text")
        problems.append(f"{serving['failed']} of {serving['requests']} client requests failed ({first})")
    if not serving["during_sync"]:
        problems.append("no client request was in flight during a sync")
    return problems


def _conclude(
    setup: DemoSetup,
    args: argparse.Namespace,
    console: Console,
    work: Path,
    reports: Sequence[SyncReport],
    outcomes: Sequence[Outcome],
    ref: Generation,
    serving: dict[str, Any],
    started: float,
) -> int:
    problems = failed_checks(reports, outcomes, ref, serving)
    if reports[-1].result is SyncResult.SUCCEEDED:
        console.print(ranks_table(reports[-1]))
    verified = ["-" if r.version == FIRST else ("no" if problems else "yes") for r in reports]
    console.print(summary_table(reports, verified))
    console.print(generation_table(outcomes, ref))
    console.print(
        f"  serving: {serving['requests']} requests, {serving['failed']} failed, "
        f"{serving['during_sync']} in flight during a sync; pause seconds per replica "
        f"{[[round(p, 3) for p in ps] for ps in serving['pause_seconds']]}; "
        f"versions seen {serving['versions_seen']}",
        highlight=False,
    )
    if args.dump is not None:
        write_outcomes(setup, work, reports[-1], outcomes, ref, reports)
        (work / "serving.json").write_text(json.dumps(serving, indent=1) + "\n")
        console.print(f"  dump written to {work}")
    elapsed = time.monotonic() - started
    if problems:
        console.print(f"[bold red]FAILED[/]: {'; '.join(problems)}", soft_wrap=True, highlight=False)
        return 1
    n = len(outcomes)
    console.print(
        f"[bold green]OK[/]: {n}/{n} replica(s) generate bit-identically to `vllm serve` loaded from "
        f"the reference checkpoint, {serving['requests']} requests served through 2 syncs, none failed, "
        f"in {elapsed:.1f}s",
        soft_wrap=True,
        highlight=False,
    )
    return 0


__all__ = ["FIRST", "Fleet", "failed_checks", "run_vllm_server_demo", "serving_summary"]
