"""`weightsync`: plan or simulate a sync from the command line; `demo` and `run` delegate.

    weightsync plan --model kimi-k2 --src "tp=8,pp=8,dp=4,ep=32" --dst "tp=16,ep=16,replicas=8" --json
    weightsync simulate --model tiny-qwen3-moe --src "tp=2,pp=2,ep=2" --dst "tp=2,ep=2,replicas=2"

Bad input to any subcommand (unknown preset, unparsable or impossible topology, a tensor no layout
covers, a bad manifest, a bad argument) prints one line `weightsync: error: ...` on stderr and exits
2, before anything starts. `simulate` exits 1 on a mismatch. Any other failure prints one line and
exits 1; `--debug` (anywhere on the line) shows the traceback instead. `demo` and `run` live in
modules that import Ray; they are imported only when asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from sync_runtime.cli.checks import InputError, check_demo, check_run
from sync_runtime.cli.sides import destination_sides
from sync_runtime.core.layouts.base import RankShard
from sync_runtime.core.manifest import MTP_PART, Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.plan import SyncPlan
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import PlanError, TopologyError, WeightSyncError
from sync_runtime.planner import MiB, PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest

PROG = "weightsync"
SIMULATE_MAX_BYTES = 256 * MiB
"""`simulate` materialises every rank's tensors in memory: tiny models only."""
DELEGATES = {"demo": "sync_runtime.demo.run", "run": "sync_runtime.runtime.loop"}
"""Subcommands implemented elsewhere: module with add_arguments(parser) and run(args) -> int."""
CHECKS = {"demo": check_demo, "run": check_run}
"""What each delegate's input must pass before its module runs (nothing started yet)."""
USER_ERRORS = (WeightSyncError, InputError)
"""Bad input, reported in one line with exit code 2; anything else is a bug and keeps its traceback."""


@dataclasses.dataclass(frozen=True)
class SyncInputs:
    """What `plan` and `simulate` plan: the model and both sides, ranks enumerated."""

    manifest: Manifest
    source: SideSpec
    destinations: tuple[SideSpec, ...]
    config: PlannerConfig


def _add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name (e.g. kimi-k2) or path of a config.json")
    parser.add_argument("--src", required=True, help='source parallelism, e.g. "tp=8,pp=8,dp=4,ep=32,etp=1"')
    parser.add_argument("--src-layout", default="megatron", help="source layout (default: megatron)")
    parser.add_argument(
        "--dst",
        required=True,
        action="append",
        help='destination parallelism, e.g. "tp=16,ep=16,replicas=8"; repeat for several destinations',
    )
    parser.add_argument(
        "--dst-layout",
        action="append",
        help="destination layout (default: vllm); once for all destinations or once per --dst",
    )
    parser.add_argument(
        "--dst-mtp",
        action="append",
        choices=("on", "off"),
        help="whether a destination serves MTP (is sent the model's MTP layers; default: off); "
        "once for all destinations or once per --dst",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node when enumerating")
    parser.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default: 64)")
    parser.add_argument("--staging-mb", type=float, default=512, help="staging budget per rank in MiB")
    parser.add_argument("--max-fan-in", type=int, default=4, help="senders one rank receives from per round")
    parser.add_argument("--relay", choices=("off", "auto", "on"), default="off", help="replica relay")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (usage stays in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Move LLM weights from trainers to inference.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also accepted after COMMAND)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser("plan", help="plan a sync and print its figures")
    _add_sync_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    plan.add_argument("--plot", metavar="FILE.png", help="write a heatmap of bytes per (sender, receiver)")
    plan.set_defaults(handler=cmd_plan)
    simulate = sub.add_parser("simulate", help="plan a sync of a tiny model and execute it in-process")
    _add_sync_arguments(simulate)
    simulate.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    simulate.set_defaults(handler=cmd_simulate)
    command = next((a for a in argv if not a.startswith("-")), None)
    for name, module in DELEGATES.items():
        delegate = sub.add_parser(name, help=f"see `{PROG} {name} --help`")
        delegate.set_defaults(handler=_delegate(name, module))
        if name == command:  # import (and so Ray) only for the subcommand actually run
            _load(module).add_arguments(delegate)
    return parser


def _load(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _DelegateMissing(f"{module} cannot be imported ({e}); is the runtime installed?") from e


class _DelegateMissing(Exception):
    pass


def _delegate(name: str, module: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        loaded = _load(module)
        if name == "run":  # vllmServers destinations are attached by the engine layer
            from sync_runtime.engines.vllm_servers import install

            install(args.namespace, args.name)
        plan_args = CHECKS[name](loaded, args)
        if plan_args is not None:  # the sync it will run, planned now: nothing has started yet
            inputs = sync_inputs(plan_args)
            plan_sync(inputs.manifest, inputs.source, inputs.destinations, inputs.config)
        return int(loaded.run(args))

    handler.__name__ = f"cmd_{name}"
    return handler


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        parser = build_parser(argv)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse already printed its one line (or --help)
            return int(e.code or 0)
        return int(args.handler(args))
    except _DelegateMissing as e:
        return _error(str(e))
    except USER_ERRORS as e:
        if debug:
            raise
        return _error(str(e))
    except KeyboardInterrupt:
        return _error("interrupted", code=130)
    except Exception as e:
        if debug:
            raise
        cause = _user_cause(e)
        if cause is not None:  # bad input found inside a Ray actor: still the user's line
            return _error(str(cause))
        return _error(f"{type(e).__name__}: {e} (rerun with --debug for the traceback)", code=1)


def _user_cause(error: BaseException) -> BaseException | None:
    """A WeightSyncError this exception wraps (a Ray task error carries it as its cause)."""
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 10:
        if isinstance(current, USER_ERRORS):
            return current
        current, seen = current.__cause__, seen + 1
    return None


def _error(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


# ---- inputs ------------------------------------------------------------------------------------


def sync_inputs(args: argparse.Namespace) -> SyncInputs:
    config = getattr(args, "model_config", None)  # set by a delegate's check for its own presets
    manifest = build_manifest(config if config is not None else load_model_config(args.model))
    if args.gpus_per_node < 1:
        raise TopologyError(f"--gpus-per-node={args.gpus_per_node}: must be >= 1")
    src_spec = ParallelSpec.parse(args.src)
    source = SideSpec(
        args.src_layout, src_spec, tuple(enumerate_ranks(src_spec, Role.SOURCE, args.gpus_per_node))
    )
    destinations = destination_sides(args)
    config = PlannerConfig(
        bucket_bytes=int(args.bucket_mb * MiB),
        staging_budget_bytes=int(args.staging_mb * MiB),
        max_fan_in=args.max_fan_in,
        relay=args.relay,
        gpus_per_node=args.gpus_per_node,
    )
    return SyncInputs(manifest, source, tuple(destinations), config)


def plan_summary(inputs: SyncInputs, plan: SyncPlan) -> dict[str, Any]:
    """The figures `plan --json` prints (plan stats without the per-rank tables, plus context)."""
    stats = {k: v for k, v in plan.stats.items() if k not in ("send_bytes", "recv_bytes")}
    return {
        "model": inputs.manifest.family,
        "model_bytes": inputs.manifest.nbytes,
        "source": f"{inputs.source.layout}:{inputs.source.spec.describe()}",
        "destinations": [f"{d.layout}:{d.spec.describe()}" for d in inputs.destinations],
        "src_ranks": len(inputs.source.coords),
        "dst_ranks": sum(len(d.coords) for d in inputs.destinations),
        "mtp_bytes": inputs.manifest.part_nbytes(MTP_PART),
        **stats,
        "digest": plan.digest,
    }


# ---- plan --------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    inputs = sync_inputs(args)
    plan = plan_sync(inputs.manifest, inputs.source, inputs.destinations, inputs.config)
    summary = plan_summary(inputs, plan)
    if args.plot:
        write_heatmap(plan, args.plot, title=heatmap_title(summary, args.model))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print_table(summary, args.model, args.plot)
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} TiB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def table_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The human summary of `plan_summary`'s figures, as (label, value) rows."""
    return [
        ("source", s["source"]),
        ("destinations", ", ".join(s["destinations"])),
        ("tensors", f"{s['tensors']:,}"),
        ("model bytes", _size(s["model_bytes"])),
        ("not synced", "; ".join(s["not_synced"]) or "-"),
        *(tuple(line.split(": ", 1)) for line in s.get("parts", ())),  # one per destination
        ("ranks src / dst", f"{s['src_ranks']} / {s['dst_ranks']}"),
        ("transfers / buckets", f"{s['transfers']:,} / {s['buckets']:,}"),
        ("rounds", f"{s['rounds']:,}"),
        ("wire / lower bound", f"{_size(s['wire_bytes'])} / {_size(s['lower_bound_bytes'])}"),
        (
            "send max / mean",
            f"{_size(s['max_send_bytes'])} / {_size(s['mean_send_bytes'])} "
            f"({_ratio(s['max_send_bytes'], s['mean_send_bytes'])})",
        ),
        (
            "recv max / mean",
            f"{_size(s['max_recv_bytes'])} / {_size(s['mean_recv_bytes'])} "
            f"({_ratio(s['max_recv_bytes'], s['mean_recv_bytes'])})",
        ),
        (
            "predicted / floor",
            f"{s['predicted_seconds']:.3f} s / {s['floor_seconds']:.3f} s "
            f"({_ratio(s['predicted_seconds'], s['floor_seconds'])})",
        ),
        ("relay", "on" if s["relay"] else "off"),
        ("plan time", f"{s['plan_seconds']:.2f} s"),
        ("digest", s["digest"][:16]),
    ]


def print_table(summary: dict[str, Any], model: str, plot: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"weightsync plan: {model}", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    for name, value in table_rows(summary) + ([("heatmap", plot)] if plot else []):
        table.add_row(name, value)
    Console().print(table)


def rank_label(coord: RankCoord) -> str:
    """Which rank this is, for a plot's axis: source pp/dp[/cp]/tp block, destination replica/pp/tp."""
    if coord.role is Role.SOURCE:
        cp = f" cp{coord.cp_rank}" if coord.cp_rank else ""  # CP ranks hold the same shards: tell them apart
        return f"pp{coord.pp_rank} dp{coord.dp_rank}{cp} tp{coord.tp_rank}"
    deployment = coord.node.split("-")[0].removeprefix("destination")  # "" or the --dst index
    stage = f" pp{coord.pp_rank}" if coord.pp_rank else ""
    return f"{'d' + deployment + ' ' if deployment else ''}r{coord.replica}{stage} tp{coord.tp_rank}"


def heatmap_title(summary: dict[str, Any], model: str) -> str:
    """`--model` as given (preset or path) with its family, then both sides' topologies."""
    sides = f"{summary['source']} -> {', '.join(summary['destinations'])}"
    return f"{model} ({summary['model']}): {sides}"


def write_heatmap(plan: SyncPlan, path: str, title: str = "") -> tuple[list[str], list[str]]:
    """Bytes per (sender, receiver) as an image: senders on rows, receivers on columns, each tick
    naming the global rank and its place in its side's topology. Returns (row, column) tick labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(plan.ranks)
    matrix = np.zeros((n, n))
    for rnd in plan.rounds:
        for b in rnd.buckets:
            matrix[b.src_rank, b.dst_rank] += b.nbytes
    senders = np.flatnonzero(matrix.sum(axis=1))
    receivers = np.flatnonzero(matrix.sum(axis=0))
    scale, unit = (2**30, "GiB") if matrix.max() >= 2**30 else (2**20, "MiB")
    fig, ax = plt.subplots(figsize=(10, 8))
    image = ax.imshow(
        matrix[np.ix_(senders, receivers)] / scale, aspect="auto", cmap="viridis", interpolation="nearest"
    )
    labels = []
    for set_ticks, set_labels, ranks in (
        (ax.set_yticks, ax.set_yticklabels, senders),
        (ax.set_xticks, ax.set_xticklabels, receivers),
    ):
        # At most ~32 ticks stay readable; each names the global rank and its coordinates.
        ticks = list(range(0, len(ranks), max(1, -(-len(ranks) // 32))))
        text = [f"{ranks[i]}: {rank_label(plan.ranks[int(ranks[i])])}" for i in ticks]
        set_ticks(ticks)
        set_labels(text, fontsize=7)
        labels.append(text)
    ax.tick_params(axis="x", labelrotation=90)
    ax.set_xlabel("receiving rank (global: replica, pp, tp)")
    ax.set_ylabel("sending rank (global: pp, dp, tp)")
    rounds = f"bytes per pair, {len(plan.rounds)} rounds" + (" (relay)" if plan.relay else "")
    ax.set_title(f"{title}\n{rounds}" if title else rounds, fontsize=9)
    fig.colorbar(image, ax=ax, label=unit)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels[0], labels[1]


# ---- simulate ----------------------------------------------------------------------------------


def all_shards(inputs: SyncInputs, ranks: Sequence[RankCoord]) -> dict[int, RankShard]:
    """Every global rank's shard, in the planner's rank order."""
    from sync_runtime.core.layouts import get_layout

    out: dict[int, RankShard] = {}
    rank = 0
    for side in (inputs.source, *inputs.destinations):
        layout = get_layout(side.layout)
        for coord in side.coords:
            assert coord == ranks[rank], "planner rank order differs from the sides' order"
            out[rank] = layout.shard(inputs.manifest, side.spec, coord)
            rank += 1
    return out


def cmd_simulate(args: argparse.Namespace) -> int:
    from sync_runtime.planner.simulate import check_plan

    inputs = sync_inputs(args)
    if inputs.manifest.nbytes > SIMULATE_MAX_BYTES:
        raise PlanError(
            f"--model {args.model} has {inputs.manifest.nbytes / MiB:.0f} MiB of weights; simulate "
            f"holds every rank's copy in memory, so it takes models up to {SIMULATE_MAX_BYTES // MiB} MiB"
        )
    plan = plan_sync(inputs.manifest, inputs.source, inputs.destinations, inputs.config)
    problems = check_plan(plan, inputs.manifest, all_shards(inputs, plan.ranks), seed=args.seed)
    s = plan.stats
    what = f"{s['transfers']} transfers in {s['rounds']} rounds, {s['wire_bytes']} bytes"
    what += f", digest {plan.digest[:16]}"
    if problems:
        print(f"MISMATCH: {len(problems)} problem(s); {what}")
        for line in problems[:20]:
            print(f"  {line}")
        return 1
    print(f"OK: every destination element written exactly once and bit-exact; {what}")
    return 0
