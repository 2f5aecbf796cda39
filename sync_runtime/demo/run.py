"""`weightsync demo`: a real sync between sharded Ray actors on one machine (helpers that tests
and end-to-end checks reuse live in demo_cluster and are re-exported here).

Default run: an embedded Ray cluster, a tiny Qwen3-MoE with seeded random bf16 weights, Megatron
sources (tp=2,pp=2,ep=2) and two vLLM replicas (tp=2,ep=2) holding stale weights; a cold sync,
a bit-exact check of every destination rank, a second sync of changed weights on the warm path
(plan and process group reused), and a summary. Modes for an external cluster:
`--participants-only` (create detached participants and exit), `--train-step V` (sources
regenerate version V), `--verify-only --expect-version V` (exit 0 only when every destination
holds exactly version V's bits).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import ray
from rich.console import Console

from sync_runtime.demo.console import ConsoleReporter, human_bytes, ranks_table, summary_table
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncReport, SyncResult
from sync_runtime.testing.cluster import (
    DEFAULT_MODEL,
    DEFAULT_NAMESPACE,
    DemoSetup,
    connect,
    create_participants,
    destination_participants,
    kill_participants,
    start_local_ray,
    train_step,
    verify_destinations,
    weightsync_spec,
)
from sync_runtime.testing.vllm_models import DEFAULT_VLLM_MODEL, vllm_model_config
from sync_runtime.testing.vllm_models import PRESETS as VLLM_PRESETS
from sync_runtime.testing.weights import reference_weights

__all__ = ["add_arguments", "main", "run"]


VLLM_SRC, VLLM_DST = "tp=2", "tp=1,replicas=2"
DEFAULTS = {
    "synthetic": (DEFAULT_MODEL, "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2"),
    "vllm": (DEFAULT_VLLM_MODEL, VLLM_SRC, VLLM_DST),
    "vllm-server": (DEFAULT_VLLM_MODEL, VLLM_SRC, VLLM_DST),
}
"""(model, src, dst) per --engine; real vLLM engines: tiny dense Qwen3, one core per engine."""
MEGATRON_DEFAULTS = {"steps": 2, "lr": 1e-6, "delta": "auto"}
"""--steps, --lr, --delta when not given (they apply to --source megatron-core only)."""


def model_config(engine: str, model: str) -> dict | None:
    """The config the demo will build `model` from, where it is not what `plan --model` reads: the
    vLLM demo's own presets (`vllm-tiny-qwen3`, ...). None: `model` is a preset or a path."""
    return vllm_model_config(model) if engine.startswith("vllm") and model in VLLM_PRESETS else None


# ---- the CLI -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("synthetic", "vllm", "vllm-server"),
        default="synthetic",
        help="destinations: synthetic vLLM-layout actors (default), real vLLM engines, or real "
        "`vllm serve` servers updated while a client keeps sending requests (both: engine env)",
    )
    parser.add_argument(
        "--model",
        help=f"preset name or path of a config.json (default {DEFAULT_MODEL}; with --engine vllm "
        f"{DEFAULT_VLLM_MODEL}, also {', '.join(p for p in VLLM_PRESETS if p != DEFAULT_VLLM_MODEL)})",
    )
    parser.add_argument(
        "--source",
        choices=("synthetic", "megatron-core"),
        default="synthetic",
        help="synthetic seeded shards (default) or real Megatron-Core trainer ranks (embedded cluster only)",
    )
    parser.add_argument(
        "--src", help=f"source (megatron) parallelism (default {DEFAULTS['synthetic'][1]}; vllm: {VLLM_SRC})"
    )
    parser.add_argument(
        "--dst",
        help=f"destination (vllm) parallelism (default {DEFAULTS['synthetic'][2]}; vllm: {VLLM_DST})",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of (seed, version)")
    _add_training_arguments(parser)
    parser.add_argument(
        "--dump",
        type=Path,
        help="write manifest, reference, every destination rank's shards and the report here "
        "(docs/design.md, section 4.4)",
    )
    parser.add_argument("--ray-address", help="use an existing Ray cluster instead of an embedded one")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of the participants")
    parser.add_argument("--src-prefix", default="trainer-", help="source actor-name prefix")
    parser.add_argument("--dst-prefix", default="infer-", help="destination actor-name prefix")
    parser.add_argument("--timeout", type=int, default=120, help="transfer timeout in seconds")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--participants-only",
        action="store_true",
        help="create detached participants (sources at --version, destinations at --stale-version)",
    )
    mode.add_argument("--train-step", metavar="VERSION", help="sources regenerate the weights of VERSION")
    mode.add_argument("--verify-only", action="store_true", help="check destinations hold --expect-version")
    parser.add_argument("--version", default="v1", help="source version for --participants-only")
    parser.add_argument("--stale-version", default="v0", help="destination version for --participants-only")
    parser.add_argument("--expect-version", help="version --verify-only expects")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The megatron-core demo's training; None when not given (cli/checks.py refuses them elsewhere)."""
    parser.add_argument(
        "--steps",
        type=int,
        help="--source megatron-core: real optimizer steps, a sync after each (default 2)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        help="--source megatron-core: Adam learning rate on the fp32 main weights (default 1e-6)",
    )
    parser.add_argument(
        "--delta",
        choices=("auto", "off"),
        help="--source megatron-core: spec.transport.delta of the syncs (default auto)",
    )


def _fill_defaults(args: argparse.Namespace) -> None:
    """Model and topologies not given take the defaults of the chosen engine."""
    model, src, dst = DEFAULTS[args.engine]
    args.model = args.model or model
    args.src = args.src or src
    args.dst = args.dst or dst
    if args.source == "megatron-core":
        for name, value in MEGATRON_DEFAULTS.items():
            setattr(args, name, value if getattr(args, name) is None else getattr(args, name))


def run(args: argparse.Namespace) -> int:
    console = Console()
    _fill_defaults(args)
    if args.engine == "vllm":
        from sync_runtime.demo.vllm_run import run_vllm_demo

        return run_vllm_demo(args, console)
    if args.engine == "vllm-server":
        from sync_runtime.demo.vllm_server_run import run_vllm_server_demo

        return run_vllm_server_demo(args, console)
    if args.source == "megatron-core":
        if args.ray_address or args.participants_only or args.train_step or args.verify_only:
            console.print("[red]--source megatron-core runs on an embedded cluster only[/]")
            return 2
        from sync_runtime.demo.megatron_run import run_megatron_demo

        return run_megatron_demo(args, console)
    setup = DemoSetup.create(
        args.model,
        args.src,
        args.dst,
        seed=args.seed,
        namespace=args.namespace,
        src_prefix=args.src_prefix,
        dst_prefix=args.dst_prefix,
    )
    if args.participants_only or args.train_step or args.verify_only:
        if not args.ray_address:
            console.print("[red]this mode needs --ray-address[/]")
            return 2
        connect(args.ray_address, args.namespace)
        return _external_mode(setup, args, console)
    return run_demo(setup, args, console)


def _external_mode(setup: DemoSetup, args: argparse.Namespace, console: Console) -> int:
    if args.participants_only:
        handles = create_participants(
            setup, src_version=args.version, dst_version=args.stale_version, detached=True
        )
        console.print(
            f"created {len(handles)} detached participants in namespace {setup.namespace!r} "
            f"(sources {setup.src_prefix}*, destinations {setup.dst_prefix}*)"
        )
        return 0
    if args.train_step:
        train_step(setup, args.train_step)
        console.print(f"sources now hold version {args.train_step}")
        return 0
    if not args.expect_version:
        console.print("[red]--verify-only needs --expect-version[/]")
        return 2
    problems = verify_destinations(setup, args.expect_version)
    for line in problems:
        console.print(f"[red]{line}[/]")
    if not problems:
        console.print(f"verified: every destination rank holds {args.expect_version} bit-exact")
    return 1 if problems else 0


def run_demo(setup: DemoSetup, args: argparse.Namespace, console: Console) -> int:
    started = time.monotonic()
    address = args.ray_address or start_local_ray(namespace=setup.namespace)
    if args.ray_address:
        connect(args.ray_address, setup.namespace)
    console.print(
        f"[bold]WeightSync demo[/]: {setup.model} ({len(setup.manifest.tensors)} tensors, "
        f"{human_bytes(setup.manifest.nbytes)} bf16), "
        f"megatron {setup.src.describe()} -> vllm {setup.dst.describe()}"
    )
    coordinator = None
    try:
        create_participants(setup, src_version="v1", dst_version="v0")
        console.print(
            f"  {setup.src.world_size} source + {setup.dst.world_size} destination actors ready "
            f"({time.monotonic() - started:.1f}s)"
        )
        spec = weightsync_spec(
            setup, "v1", address=address, transport=Transport(transfer_timeout_seconds=args.timeout)
        )
        reporter = ConsoleReporter(console)
        coordinator = Coordinator(spec, reporter, manifest=setup.manifest)
        reports, verified = _two_syncs(setup, coordinator, console)
        if args.dump and reports[-1].result is SyncResult.SUCCEEDED:
            _dump(setup, args.dump, reports)
            console.print(f"  dump written to {args.dump}")
        console.print(ranks_table(reports[-1]))
        console.print(summary_table(reports, verified))
        ok = all(r.result is SyncResult.SUCCEEDED for r in reports) and all(
            v.startswith("yes") for v in verified
        )
        console.print(
            f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/] "
            f"in {time.monotonic() - started:.1f}s"
        )
        return 0 if ok else 1
    finally:
        if coordinator is not None:
            coordinator.close()
        kill_participants(setup)
        if not args.ray_address:
            ray.shutdown()


def _two_syncs(
    setup: DemoSetup, coordinator: Coordinator, console: Console
) -> tuple[list[SyncReport], list[str]]:
    reports, verified = [], []
    for version in ("v1", "v2"):
        if version != "v1":
            train_step(setup, version)
            console.print(f"  sources trained a step: now {version}")
        report = coordinator.sync(version)
        reports.append(report)
        if report.result is not SyncResult.SUCCEEDED:
            verified.append("no (sync failed)")
            break
        problems = verify_destinations(setup, version)
        for line in problems:
            console.print(f"  [red]{line}[/]")
        verified.append("no" if problems else f"yes ({setup.dst.world_size} ranks)")
    return reports, verified


def _dump(setup: DemoSetup, out: Path, reports: list[SyncReport]) -> None:
    from sync_runtime.demo.dump import write_dump

    report = reports[-1]
    write_dump(
        out,
        model_config=setup.config,
        src_layout="megatron",
        src=setup.src,
        dst=setup.dst,
        reference=reference_weights(setup.manifest, setup.seed, report.version),
        destinations=destination_participants(setup),
        report=report,
        syncs=reports,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync demo")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
