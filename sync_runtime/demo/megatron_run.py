"""`weightsync demo --source megatron-core`: real Megatron-Core trainer ranks as the source.

The trainers hold a bf16 model with fp32 main weights (`megatron_trainer.py`); blank vLLM-layout
destinations wait. Each of `--steps` real optimizer steps is followed by a sync through one
coordinator (plan and process group reused), so from the second sync on every replica holds the
previous version and, with `--delta auto`, takes a delta. After each sync every destination rank
is checked bit for bit against the reference: canonical HF tensors converted from the trainers'
own shards. `--dump DIR` writes the default demo's files for the last sync (manifest,
reference.safetensors, every destination rank's shards, report.json with every sync listed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.demo.console import human_bytes
from sync_runtime.demo.megatron_trainer import start_mixed_trainers
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncReport, SyncResult
from sync_runtime.testing.cluster import weightsync_spec
from sync_runtime.testing.megatron_deploy import MegatronDeployment, QuietReporter, save_reference

BATCH_SEED = 100
"""Step k trains on the seeded batch BATCH_SEED + k (a different batch each step)."""


@dataclass(slots=True)
class StepSync:
    """One step's sync and what the check found."""

    report: SyncReport
    problems: list[str]
    loss: float | None


def run_megatron_demo(args: Any, console: Any) -> int:
    """The demo with `--source megatron-core` (embedded Ray cluster only)."""
    from sync_runtime.core.models import load_model_config
    from sync_runtime.testing.cluster import start_local_ray

    started = time.monotonic()
    address = start_local_ray(namespace=args.namespace)
    src = ParallelSpec.parse(args.src)
    console.print(
        f"[bold]WeightSync demo[/]: megatron-core {src.describe()} -> vllm {args.dst} ({args.model}); "
        f"{args.steps} step(s) at lr {args.lr:g}, bf16 with fp32 main weights, delta {args.delta}"
    )
    dep = MegatronDeployment(
        args.namespace, start_mixed_trainers(src.world_size, args.namespace, args.src_prefix), args.src_prefix
    )
    coordinator = None
    syncs: list[StepSync] = []
    try:
        built = dep.build(
            load_model_config(args.model), args.src, args.dst, seed=args.seed, version="v0", lr=args.lr
        )
        console.print(
            f"  {len(dep.trainers)} Megatron-Core trainer ranks ({built[0]['layout']} layout) and "
            f"{len(dep.destinations)} destination ranks ready ({time.monotonic() - started:.1f}s)"
        )
        assert dep.setup is not None
        transport = Transport(transfer_timeout_seconds=args.timeout, delta=args.delta)
        spec = weightsync_spec(dep.setup, "v1", address=address, transport=transport)
        coordinator = Coordinator(spec.model_copy(update={"model": None}), QuietReporter())
        syncs = _train_and_sync(dep, coordinator, args, console)
        if args.dump and syncs and syncs[-1].report.result is SyncResult.SUCCEEDED:
            _dump(dep, args.dump, [s.report for s in syncs])
            console.print(f"  dump of the last sync written to {args.dump}")
    finally:
        if coordinator is not None:
            coordinator.close()
        dep.close()
        ray.shutdown()
    ok = len(syncs) == args.steps and all(
        s.report.result is SyncResult.SUCCEEDED and not s.problems for s in syncs
    )
    console.print(
        f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/] in {time.monotonic() - started:.1f}s"
    )
    return 0 if ok else 1


def _train_and_sync(
    dep: MegatronDeployment, coordinator: Coordinator, args: Any, console: Any
) -> list[StepSync]:
    """Step k (1..N) trains, names its weights `v{k}`, syncs them and checks every destination.
    Stops at the first sync that fails."""
    out: list[StepSync] = []
    for k in range(1, args.steps + 1):
        version = f"v{k}"
        losses = ray.get([h.step.remote(version, seed=BATCH_SEED + k) for h in dep.trainers])
        loss = max((x for x in losses if x is not None), default=None)
        reference = dep.reference()
        report = coordinator.sync(version)
        ok = report.result is SyncResult.SUCCEEDED
        problems = dep.verify(reference, version) if ok else [f"sync failed: {report.failure}"]
        out.append(StepSync(report, problems, loss))
        for line in problems:
            console.print(f"  [red]{line}[/]")
        console.print(_line(k, out[-1]))
        if not ok:
            break
    return out


def _line(k: int, s: StepSync) -> str:
    r = s.report
    loss = f"loss {s.loss:.4f}" if s.loss is not None else "no loss"
    changed = f", {r.changed_fraction:.3%} of elements changed" if r.changed_fraction is not None else ""
    check = "bit-exact vs the trainers' reference" if not s.problems else "NOT verified"
    return (
        f"  step {k} ({loss}) -> sync {r.version}: {r.result.value} in {r.seconds:.2f}s, {r.encoding}, "
        f"wire {human_bytes(r.wire_bytes)} of {human_bytes(r.full_bytes)}{changed}; {check}"
    )


def _dump(dep: MegatronDeployment, out: Path, reports: list[SyncReport]) -> None:
    """The default demo's files, for the last sync: reference = what the trainers hold now."""
    from sync_runtime.demo.dump import write_destinations, write_manifest, write_report
    from sync_runtime.testing.cluster import destination_participants

    setup = dep.setup
    assert setup is not None
    write_manifest(out, model_config=setup.config, src_layout="megatron", src=setup.src, dst=setup.dst)
    save_reference(dep.reference(), out / "reference.safetensors")
    write_destinations(out, destination_participants(setup))
    write_report(out, reports[-1], reports)
