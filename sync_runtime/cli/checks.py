"""Input checks the CLI runs before a delegated subcommand starts anything (Ray, actors, a sync).

`demo` would otherwise find an impossible topology only inside its Ray actors, half a minute
and a remote traceback later; `run --config` would print pydantic's multi-line dump. Both are
bad input: one line, exit 2, raised here as `InputError` and printed by `main`.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = ["InputError", "check_demo", "check_run", "describe_validation"]


class InputError(ValueError):
    """A bad argument or file found before anything started. Not a WeightSyncError: no sync exists
    yet, so it has no condition reason; `main` prints it as one line with exit 2 all the same."""


def check_demo(module: Any, args: argparse.Namespace) -> argparse.Namespace | None:
    """Fill the engine's defaults as `demo` will; return the `plan` arguments of its sync, which the
    caller plans so that topology errors surface before Ray starts."""
    if args.source == "megatron-core" and (
        args.ray_address or args.participants_only or args.train_step or args.verify_only
    ):
        raise InputError(
            "--source megatron-core runs on an embedded cluster only (no --ray-address or modes)"
        )
    if (args.participants_only or args.train_step or args.verify_only) and not args.ray_address:
        raise InputError("--participants-only, --train-step and --verify-only need --ray-address")
    if args.verify_only and not args.expect_version:
        raise InputError("--verify-only needs --expect-version")
    if args.timeout < 1:
        raise InputError(f"--timeout={args.timeout}: must be >= 1 second")
    _check_training(args)
    model, src, dst = module.DEFAULTS[args.engine]
    args.model, args.src, args.dst = args.model or model, args.src or src, args.dst or dst
    plan_args = _plan_args(args.model, args.src, [args.dst], "megatron", None)
    plan_args.model_config = module.model_config(args.engine, args.model)  # the demo's own presets
    return plan_args


def _check_training(args: argparse.Namespace) -> None:
    """--steps, --lr, --delta: the megatron-core demo's training; elsewhere they would be ignored."""
    given = [f"--{n}" for n in ("steps", "lr", "delta") if getattr(args, n, None) is not None]
    if args.source != "megatron-core":
        if given:
            raise InputError(f"{', '.join(given)}: only with --source megatron-core (real optimizer steps)")
        return
    if args.steps is not None and args.steps < 1:
        raise InputError(f"--steps={args.steps}: must be >= 1 (a sync follows each step)")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise InputError(f"--lr={args.lr}: must be a finite number > 0")


def check_run(module: Any, args: argparse.Namespace) -> argparse.Namespace | None:
    """The mode's required arguments, and a `--config` manifest read and validated."""
    if args.kubernetes:
        if not (args.namespace and args.name):
            raise InputError("run --kubernetes needs --namespace and --name (or WEIGHTSYNC_NAMESPACE/NAME)")
        return None
    if not args.config:
        raise InputError("run needs --config FILE (one sync) or --kubernetes (the runtime pod)")
    import pydantic
    import yaml

    try:
        spec = module.load_spec_file(args.config)
    except OSError as e:
        raise InputError(f"--config {args.config}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise InputError(f"--config {args.config}:{where}: not YAML: {problem}") from e
    except pydantic.ValidationError as e:
        raise InputError(f"--config {args.config}: {describe_validation(e)}") from e
    except ValueError as e:
        raise InputError(str(e)) from e
    if not spec.model:  # the model comes from the source actors: planned once they are found
        return None
    # A named model: plan the declared topologies now, as `plan` would, before connecting to Ray.
    return _plan_args(
        spec.model,
        spec.source.parallelism.to_spec().describe(),
        [d.parallelism.to_spec().describe() for d in spec.destinations],
        spec.source.layout,
        [d.layout for d in spec.destinations],
    )


def _plan_args(
    model: str, src: str, dst: list[str], src_layout: str, dst_layout: list[str] | None
) -> argparse.Namespace:
    """The `plan` subcommand's arguments for one sync, with its default budgets."""
    return argparse.Namespace(
        model=model,
        src=src,
        dst=dst,
        src_layout=src_layout,
        dst_layout=dst_layout,
        gpus_per_node=8,
        bucket_mb=64,
        staging_mb=512,
        max_fan_in=4,
        relay="off",
    )


def describe_validation(invalid: Any) -> str:
    """A pydantic ValidationError as `spec.field: problem` items, joined by '; ' (no input dump)."""
    items, problems = [], invalid.errors(include_url=False, include_input=False)
    for item in problems:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        items.append(f"spec{loc}: {message}")
    return "; ".join(items)
