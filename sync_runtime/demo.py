"""`weightsync demo`: a real sync between sharded Ray actors on one machine, plus the helpers
tests and end-to-end checks reuse (create seeded participants, "train a step", verify).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from sync_runtime.console import ConsoleReporter, human_bytes, summary_table
from sync_runtime.coordinator import Coordinator
from sync_runtime.crd import DeploymentRef, Parallelism, Transport, WeightSyncSpec
from sync_runtime.demo_weights import (
    DemoDestination,
    DemoSource,
    expected_sha256,
    model_config,
    reference_weights,
)
from sync_runtime.discovery import Participant, find_actors, gather
from sync_runtime.manifest import Manifest
from sync_runtime.models import build_manifest
from sync_runtime.report import SyncReport, SyncResult
from sync_runtime.topology import ParallelSpec, RankCoord, Role, enumerate_ranks

DEFAULT_MODEL = "tiny-qwen3-moe"
DEFAULT_NAMESPACE = "weightsync-demo"
READY_TIMEOUT_S = 180.0
"""Actor start-up on a loaded 2-core machine: each worker imports torch."""


@dataclass(kw_only=True)
class DemoSetup:
    """Everything that defines a demo deployment pair: model, topologies, seed, where the actors live."""

    model: str
    config: dict[str, Any]
    manifest: Manifest
    src: ParallelSpec
    dst: ParallelSpec
    seed: int = 0
    namespace: str = DEFAULT_NAMESPACE
    src_prefix: str = "trainer-"
    dst_prefix: str = "infer-"
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        model: str = DEFAULT_MODEL,
        src: str | ParallelSpec = "tp=2,pp=2,ep=2",
        dst: str | ParallelSpec = "tp=2,ep=2,replicas=2",
        **kw: Any,
    ) -> DemoSetup:
        config = model_config(model)
        return cls(
            model=model,
            config=config,
            manifest=build_manifest(config),
            src=src if isinstance(src, ParallelSpec) else ParallelSpec.parse(src),
            dst=dst if isinstance(dst, ParallelSpec) else ParallelSpec.parse(dst),
            **kw,
        )


def source_name(prefix: str, c: RankCoord) -> str:
    return f"{prefix}src-pp{c.pp_rank}-dp{c.dp_rank}-tp{c.tp_rank}"


def destination_name(prefix: str, c: RankCoord) -> str:
    return f"{prefix}r{c.replica}-pp{c.pp_rank}-tp{c.tp_rank}"


def start_local_ray(num_cpus: int = 2, namespace: str = DEFAULT_NAMESPACE) -> str:
    """An embedded Ray cluster sized for CI (no dashboard, small object store); returns its address."""
    if not ray.is_initialized():
        ray.init(
            address="local",  # always a fresh cluster: never join one another process started here
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=128 << 20,
            namespace=namespace,
            logging_level="WARNING",
            log_to_driver=False,
        )
    return ray.get_runtime_context().gcs_address


def connect(address: str, namespace: str) -> None:
    """Join an existing cluster as a driver (token auth: RAY_AUTH_MODE/RAY_AUTH_TOKEN in the env)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level="WARNING", log_to_driver=False)


ClassFor = Callable[[RankCoord], type]


def create_participants(
    setup: DemoSetup,
    *,
    src_version: str,
    dst_version: str,
    detached: bool = False,
    source_class: ClassFor | None = None,
    dest_class: ClassFor | None = None,
    skip: Callable[[RankCoord], bool] | None = None,
) -> list[Any]:
    """Start one named actor per rank and wait until all are ready.

    Sources hold the weights of `src_version`, destinations those of `dst_version`.

    `source_class`/`dest_class` pick a class per rank (tests use faulty subclasses); `skip`
    leaves ranks out (tests of a missing rank).
    """
    specs = [
        (
            c,
            source_name(setup.src_prefix, c),
            (source_class or (lambda _: DemoSource))(c),
            setup.src,
            src_version,
        )
        for c in enumerate_ranks(setup.src, Role.SOURCE, gpus_per_node=1 << 20)
    ] + [
        (
            c,
            destination_name(setup.dst_prefix, c),
            (dest_class or (lambda _: DemoDestination))(c),
            setup.dst,
            dst_version,
        )
        for c in enumerate_ranks(setup.dst, Role.DESTINATION, gpus_per_node=1 << 20)
    ]
    handles = []
    for coord, name, cls, spec, version in specs:
        if skip is not None and skip(coord):
            continue
        # Real placement comes from the actor itself (node IP, CPU device), not from enumerate_ranks.
        coord = RankCoord(
            role=coord.role,
            replica=coord.replica,
            tp_rank=coord.tp_rank,
            pp_rank=coord.pp_rank,
            dp_rank=coord.dp_rank,
            ep_rank=coord.ep_rank,
            etp_rank=coord.etp_rank,
            edp_rank=coord.edp_rank,
        )
        options: dict[str, Any] = {"name": name, "namespace": setup.namespace, "num_cpus": 0}
        if detached:
            options["lifetime"] = "detached"
        actor = ray.remote(cls).options(**options).remote(setup.config, spec, coord, setup.seed, version)
        handles.append(actor)
    ready, pending = ray.wait(
        [h.ws_version.remote() for h in handles], num_returns=len(handles), timeout=READY_TIMEOUT_S
    )
    if pending:
        raise TimeoutError(f"{len(pending)} participant(s) not ready within {READY_TIMEOUT_S:g}s")
    ray.get(ready)  # surfaces constructor errors
    setup.handles.extend(handles)
    return handles


def weightsync_spec(
    setup: DemoSetup,
    version: str,
    *,
    address: str,
    transport: Transport | None = None,
    src: ParallelSpec | None = None,
    dst: ParallelSpec | None = None,
) -> WeightSyncSpec:
    """The WeightSync the demo (or a test) runs; `src`/`dst` override the declared parallelism."""

    def ref(name: str, prefix: str, layout: str, spec: ParallelSpec) -> DeploymentRef:
        par = Parallelism(
            tp=spec.tp,
            pp=spec.pp,
            dp=spec.dp,
            ep=spec.ep,
            etp=spec.etp,
            vpp=spec.vpp,
            replicas=spec.replicas,
            layer_counts=list(spec.layer_counts) if spec.layer_counts else None,
        )
        return DeploymentRef(
            name=name,
            ray_address=address,
            ray_namespace=setup.namespace,
            actor_prefix=prefix,
            layout=layout,
            parallelism=par,
        )

    return WeightSyncSpec(
        source=ref("trainer", setup.src_prefix, "megatron", src or setup.src),
        destinations=[ref("inference", setup.dst_prefix, "vllm", dst or setup.dst)],
        version=version,
        model=setup.model,
        transport=transport or Transport(),
    )


def train_step(setup: DemoSetup, version: str) -> None:
    """Every source regenerates the seeded weights of `version` in place."""
    actors = find_actors(setup.namespace, setup.src_prefix)
    ray.get([h.ws_set_version_weights.remote(setup.seed, version) for _, h in actors])


def destination_participants(setup: DemoSetup, timeout_s: float = 60.0) -> list[Participant]:
    ref = DeploymentRef(
        name="inference",
        ray_address="-",
        ray_namespace=setup.namespace,
        actor_prefix=setup.dst_prefix,
        layout="vllm",
    )
    found = gather(ref, timeout_s)
    return sorted(found, key=lambda p: p.meta.coord.key)


def verify_destinations(setup: DemoSetup, version: str) -> list[str]:
    """Problems found (empty = every destination rank holds exactly version `version`, bit for bit)."""
    problems = []
    participants = destination_participants(setup)
    sums = ray.get([p.handle.ws_sha256.remote() for p in participants])
    for p, got in zip(participants, sums, strict=True):
        if p.meta.version != version:
            problems.append(f"{p.name}: version {p.meta.version!r}, expected {version!r}")
        want = expected_sha256(setup.manifest, "vllm", setup.dst, p.meta.coord, setup.seed, version)
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        if bad:
            problems.append(f"{p.name}: {len(bad)} tensor(s) differ from the reference, e.g. {bad[0]}")
    expected_ranks = setup.dst.world_size
    if len(participants) != expected_ranks:
        problems.append(f"found {len(participants)} destination ranks, expected {expected_ranks}")
    return problems


def kill_participants(setup: DemoSetup) -> None:
    for h in setup.handles:
        ray.kill(h, no_restart=True)
    setup.handles.clear()


# ---- the CLI -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name or path of a config.json")
    parser.add_argument("--src", default="tp=2,pp=2,ep=2", help="source (megatron) parallelism")
    parser.add_argument("--dst", default="tp=2,ep=2,replicas=2", help="destination (vllm) parallelism")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of (seed, version)")
    parser.add_argument("--dump", type=Path, help="write DESIGN 4.4 files here")
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


def run(args: argparse.Namespace) -> int:
    console = Console()
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
            _dump(setup, args.dump, reports[-1])
            console.print(f"  dump written to {args.dump}")
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


def _dump(setup: DemoSetup, out: Path, report: SyncReport) -> None:
    from sync_runtime.dump import write_dump

    write_dump(
        out,
        model_config=setup.config,
        src_layout="megatron",
        src=setup.src,
        dst=setup.dst,
        reference=reference_weights(setup.manifest, setup.seed, report.version),
        destinations=destination_participants(setup),
        report=report,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync demo")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
