"""`weightsync demo --engine vllm`: a sync into real vLLM engines, judged by what they generate.

An embedded Ray cluster; the demo's Megatron-layout source actors holding shards of the seeded
canonical weights (version v1); N destination replicas run as users run vLLM in Ray: each a plain
actor holding a `vllm.LLM` (its engine core in the actor's process, so is its one worker at TP 1)
started with dummy weights and `weight_transfer_config={"backend": "weightsync"}` (the plugin,
engines/vllm_plugin/), nothing from WeightSync inside it (sync_runtime/testing/vllm_user_engines.py),
attached the documented way, `attach(name,
namespace, ActorControl(actor))`: a WeightSync proxy per engine that discovery finds by name and
that drives the engine through vLLM's own weight-transfer API. The oracle is the same actor
without the backend, loaded by vLLM's loader (`load_format="auto"`) from reference.safetensors,
the canonical weights as an HF checkpoint. Every engine generates greedily from fixed prompt token
ids before the sync (the negative control: dummy weights) and after it; the demo passes (exit 0)
only when every replica's token ids and logprobs equal the oracle's bit for bit, its dummy
generation differs, the bytes each rank applied are its layout shard (each worker's checksums,
asked through its proxy) and the engine's weight version label is the synced version.

Runs in the engine environment (vLLM is imported by the engine actors): `make demo
ARGS="--engine vllm"` picks it. With WEIGHTSYNC_REFERENCE_CACHE=1 the oracle's outputs come from
the reference cache when it holds them for exactly this oracle (`user_oracle_key`; the tests set
it) and no oracle engine starts; a line says which. Each prompt is generated alone (vLLM's CPU
MLA kernels are not batch-invariant, see UserEngine.generate). Refused: expert parallel (vLLM's
CPU fused-MoE kernel crashes generating with it, docs/vllm.md) and pipeline parallel (not tested
through the plugin, docs/vllm.md "What is not there yet").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from rich.console import Console
from rich.table import Table

from sync_runtime.core.topology import ParallelSpec, Role
from sync_runtime.demo.console import ConsoleReporter, human_bytes, ranks_table, summary_table
from sync_runtime.demo.dump import write_manifest, write_reference, write_report
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncReport, SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    kill_participants,
    start_local_ray,
    weightsync_spec,
)
from sync_runtime.testing.vllm_deploy import (
    Generation,
    generations,
    replica_env,
    stop_engines_and_proxies,
    stop_replicas,
    token_rows_equal,
)
from sync_runtime.testing.vllm_models import PROMPTS, model_dir_for, vllm_model_config
from sync_runtime.testing.vllm_oracle_keys import DemoOracle
from sync_runtime.testing.vllm_user_engines import (
    attach_user_engines,
    start_user_engine,
    user_oracle_key,
    wait_started,
)
from sync_runtime.testing.weights import bits_to_torch, reference_weights, shard_arrays
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest

VERSION = "v1"
ENGINE_ENV_HINT = (
    'make demo ARGS="--engine vllm ..." (it runs in tools/vllm_env.sh\'s environment), or '
    "VE=$(bash tools/vllm_env.sh); PYTHONPATH=$PWD $VE/bin/python -m sync_runtime demo --engine vllm ..."
)


@dataclass
class Outcome:
    """What one replica showed: generations before and after the sync, the applied checksums."""

    replica: int
    before: Generation
    after: Generation | None = None
    applied: list[dict[str, Any]] = field(default_factory=list)

    def bit_identical(self, ref: Generation) -> bool:
        return self.after == ref

    def before_differs(self, ref: Generation) -> bool:
        return token_rows_equal(self.before, ref) == 0

    def applied_ok(self) -> bool:
        return bool(self.applied) and all(r["applied"] == r["expected"] for r in self.applied)


def refusal(args: argparse.Namespace, config: dict[str, Any], dst: ParallelSpec) -> str | None:
    """Why this run cannot be made (one line), or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"--engine vllm needs vLLM, which {sys.executable} cannot import. Run it with {ENGINE_ENV_HINT}"
        )
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(ep.value.startswith("sync_runtime.engines.vllm_plugin") for ep in plugins):
        return (
            f"--engine vllm: the weightsync vLLM plugin is not installed in {sys.prefix} "
            "(pip install weightsync there: its vllm.general_plugins entry point registers the backend)"
        )
    if args.source != "synthetic" or args.ray_address or args.participants_only or args.train_step:
        return "--engine vllm runs synthetic sources on an embedded cluster only"
    if args.verify_only:
        return "--engine vllm runs synthetic sources on an embedded cluster only"
    if dst.pp != 1 or dst.ep != 1:
        return (
            f"--dst {dst.describe()}: --engine vllm takes tp and replicas only (pipeline parallel is not "
            "tested through the plugin; vLLM 0.32's CPU fused-MoE kernel crashes generating with expert "
            "parallel)"
        )
    return None


def reference_setup(
    args: argparse.Namespace, config: dict[str, Any], dst: ParallelSpec, work: Path
) -> tuple[Path, DemoSetup]:
    """The oracle's model directory and the demo's sides (both vLLM demos).

    The checkpoint comes first: `reference.safetensors` holds the weights of the version the syncs
    must reach, written before any engine starts, and vLLM's own loader reads it for the oracle.
    """
    model_dir = Path(model_dir_for(work / "reference-model", config, work / "reference.safetensors"))
    setup = DemoSetup.create(
        str(model_dir / "config.json"),
        args.src,
        dst,
        seed=args.seed,
        namespace=args.namespace,
        src_prefix=args.src_prefix,
        dst_prefix=args.dst_prefix,
    )
    write_reference(work, reference_weights(setup.manifest, setup.seed, VERSION))
    return model_dir, setup


def run_vllm_demo(args: argparse.Namespace, console: Console) -> int:
    config = vllm_model_config(args.model)
    dst = ParallelSpec.parse(args.dst)
    problem = refusal(args, config, dst)
    if problem is not None:
        console.print(f"[red]weightsync demo: {problem}[/]", highlight=False)
        return 2
    work = args.dump or Path(tempfile.mkdtemp(prefix="weightsync-vllm-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        _, setup = reference_setup(args, config, dst, work)
        address = start_local_ray(namespace=setup.namespace)
        return _deploy_and_check(setup, args, console, work, address, started)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if args.dump is None:
            shutil.rmtree(work, ignore_errors=True)


def _start_replicas(model_dir: str, dst: ParallelSpec) -> list[Any]:
    """The destination engines, started (not waited for). A replica's engine core runs in its
    actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as RL frameworks run `vllm.LLM`), and at
    TP 1 so does its one worker (vLLM's own default executor for one worker, "uni"): every
    process not started saves seconds of torch and vLLM imports (measured: 2 TP 1 replicas ready
    in 18.7 s against 36.6 s with a core and a worker apart)."""
    args = {"distributed_executor_backend": "uni"} if dst.tp == 1 else None
    return [start_user_engine(model_dir, dst.tp, args, env=replica_env(dst.tp)) for _ in range(dst.replicas)]


def _deploy_and_check(
    setup: DemoSetup, args: argparse.Namespace, console: Console, work: Path, address: str, started: float
) -> int:
    dst, model_dir = setup.dst, str(work / "reference-model")
    # the oracle generates twice, as the replicas do (dummy weights, then synced): like with like
    oracle = DemoOracle.look_up(lambda: user_oracle_key(model_dir, tp=dst.tp, calls=2))
    console.print(
        f"[bold]WeightSync demo (vLLM engines)[/]: {setup.config['architectures'][0]} "
        f"({len(setup.manifest.tensors)} tensors, {human_bytes(setup.manifest.nbytes)} bf16), "
        f"megatron {setup.src.describe()} -> {dst.replicas} vllm.LLM engine(s) tp={dst.tp} in plain Ray "
        f"actors (weightsync backend), oracle: vLLM loading {work / 'reference.safetensors'}"
    )
    # every engine builds in the background, together (one after another would take minutes longer)
    replicas = _start_replicas(model_dir, dst)
    reference = (
        None if oracle.cached else start_user_engine(model_dir, dst.tp, load_format="auto", backend=False)
    )
    engines = [*replicas, *([reference] if reference is not None else [])]
    proxies: list[Any] = []
    try:
        create_participants(
            setup, src_version=VERSION, dst_version="-", skip=lambda c: c.role is Role.DESTINATION
        )
        wait_started(engines)
        proxies = attach_user_engines(replicas, setup.dst_prefix, setup.namespace, tp=dst.tp)
        console.print(
            f"  {setup.src.world_size} source actors and {len(engines)} vLLM engines ready, "
            f"{len(proxies)} attached as destination replicas ({time.monotonic() - started:.1f}s)"
        )
        if oracle.runs is not None:
            ref_runs = oracle.runs
        else:
            assert reference is not None
            ref_runs = oracle.keep([generations([reference])[0] for _ in range(2)])
            stop_replicas([reference])
        console.print(f"  {oracle.line()}", soft_wrap=True, highlight=False)
        ref = ref_runs[1]
        if ref_runs[0] != ref:
            console.print("  [yellow]the reference engine did not repeat itself; comparing 2nd calls[/]")
        outcomes = [Outcome(k, g) for k, g in enumerate(generations(replicas))]
        report = _sync(setup, args, console, address)
        labels: list[str] = []
        if report.result is SyncResult.SUCCEEDED:
            for o, g in zip(outcomes, generations(replicas), strict=True):
                o.after = g
            applied_checksums(setup, proxies, outcomes)
            labels = [str(v) for v in ray.get([e.weight_version.remote() for e in replicas], timeout=60)]
            console.print(f"  the engines' weight version labels after the sync: {labels}")
        return _conclude(setup, args, console, work, report, outcomes, ref, started, labels)
    finally:
        stop_engines_and_proxies(engines, proxies)
        kill_participants(setup)


def _sync(setup: DemoSetup, args: argparse.Namespace, console: Console, address: str) -> SyncReport:
    spec = weightsync_spec(
        setup, VERSION, address=address, transport=Transport(transfer_timeout_seconds=args.timeout)
    )
    coordinator = Coordinator(spec, ConsoleReporter(console), manifest=setup.manifest)
    try:
        return coordinator.sync(VERSION)
    finally:
        coordinator.close()


def applied_checksums(setup: DemoSetup, proxies: Sequence[Any], outcomes: Sequence[Outcome]) -> None:
    """Per rank: checksums of the bytes it applied vs those of its layout shard of the reference,
    asked of each replica's WeightSync proxy (`attach`), which forwards the call to the worker's
    backend through vLLM's own update_weights (engines/vllm_ranks.py)."""
    for h, o in zip(proxies, outcomes, strict=True):
        for i, meta in enumerate(ray.get(h.ws_meta.remote())):
            applied = ray.get(h.ws_rank_call.remote(i, "ws_checksums", ()))
            dtypes = ray.get(h.ws_rank_call.remote(i, "ws_staging_dtypes", ()))
            want = shard_arrays(setup.manifest, "vllm", setup.dst, meta.coord, setup.seed, VERSION)
            # staged in the live dtype: DeepSeek's fp32 router bias is the bf16 value widened
            tensors = {n: bits_to_torch(a).to(getattr(torch, dtypes[n])) for n, a in want.items()}
            expected = {n: hex_digest(checksum_tensor(t)) for n, t in tensors.items()}
            o.applied.append(
                {"pp": meta.coord.pp_rank, "tp": meta.coord.tp_rank, "applied": applied, "expected": expected}
            )


def _conclude(
    setup: DemoSetup,
    args: argparse.Namespace,
    console: Console,
    work: Path,
    report: SyncReport,
    outcomes: Sequence[Outcome],
    ref: Generation,
    started: float,
    labels: Sequence[str],
) -> int:
    """`labels`: each replica's weight version label after the sync (vLLM's, which the proxy's
    commit sets through finish_weight_update): every one must be the synced version."""
    synced = report.result is SyncResult.SUCCEEDED
    labelled = list(labels) == [VERSION] * len(outcomes)
    ok = (
        synced
        and labelled
        and all(o.bit_identical(ref) and o.before_differs(ref) and o.applied_ok() for o in outcomes)
    )
    if synced:
        console.print(ranks_table(report))
    verified = "yes" if ok else ("no" if synced else "no (sync failed)")
    console.print(summary_table([report], [verified]))
    console.print(generation_table(outcomes, ref))
    if args.dump is not None:
        write_outcomes(setup, work, report, outcomes, ref)
        console.print(f"  dump written to {work}")
    if synced and not labelled:
        console.print(f"  [red]weight version labels {list(labels)}: every replica's must be {VERSION!r}[/]")
    console.print(
        f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/]: "
        f"{sum(o.bit_identical(ref) for o in outcomes)}/{len(outcomes)} replica(s) generate bit-identically "
        f"to vLLM loaded from the reference checkpoint, in {time.monotonic() - started:.1f}s"
    )
    return 0 if ok else 1


def generation_table(outcomes: Sequence[Outcome], ref: Generation) -> Table:
    n = len(ref)
    table = Table(
        title=f"greedy generation vs the reference engine ({n} prompts, {len(ref[0]['token_ids'])} tokens)"
    )
    for col in (
        "replica",
        "before sync: same tokens",
        "after: same tokens",
        "after: same logprobs",
        "applied bytes",
        "bit-identical",
    ):
        table.add_column(col, justify="right")
    for o in outcomes:
        after = o.after
        same_tokens = token_rows_equal(after, ref) if after is not None else 0
        same_lps = (
            sum(a["logprobs"] == r["logprobs"] for a, r in zip(after, ref, strict=True)) if after else 0
        )
        table.add_row(
            str(o.replica),
            f"{token_rows_equal(o.before, ref)}/{n} (must be 0)",
            f"{same_tokens}/{n}",
            f"{same_lps}/{n}",
            "= layout shard" if o.applied_ok() else "[red]differ[/]",
            "[green]yes[/]" if o.bit_identical(ref) else "[red]no[/]",
        )
    return table


def write_outcomes(
    setup: DemoSetup,
    work: Path,
    report: SyncReport,
    outcomes: Sequence[Outcome],
    ref: Generation,
    syncs: Sequence[SyncReport] = (),
) -> None:
    """design §4.4 (minus the unreadable vLLM tensors: checksums instead) plus generation.json;
    `syncs`: every sync of the run, for report.json (default: `report` alone)."""
    write_manifest(work, model_config=setup.config, src_layout="megatron", src=setup.src, dst=setup.dst)
    write_report(work, report, syncs)
    for o in outcomes:
        out = work / "destination" / f"replica-{o.replica}"
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "prompt_token_ids": [list(p) for p in PROMPTS],
            "token_ids": [r["token_ids"] for r in o.after or []],
            "logprobs": [r["logprobs"] for r in o.after or []],
            "before_sync_token_ids": [r["token_ids"] for r in o.before],
            "reference": {
                "token_ids": [r["token_ids"] for r in ref],
                "logprobs": [r["logprobs"] for r in ref],
            },
        }
        (out / "generation.json").write_text(json.dumps(doc) + "\n")
        for rank in o.applied:
            (out / f"pp{rank['pp']}-tp{rank['tp']}.checksums.json").write_text(
                json.dumps(rank, indent=1) + "\n"
            )
