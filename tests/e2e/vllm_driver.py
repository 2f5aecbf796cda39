"""Ray driver of tests/e2e/test_vllm_e2e.py: real vLLM destinations in the e2e Ray cluster.

Runs in a subprocess with the cluster's ``env()`` (token auth) under the engine environment's
Python; each subcommand connects, acts, prints one JSON line and exits. A subprocess, not the
pytest process: in ``make test-engines`` the pytest process is already a driver of the engine
tests' own (unauthenticated) local cluster, and one process joins one Ray cluster.

    python vllm_driver.py up --namespace NS --config C --seed S --version V --src P --dst-prefix D \
        --reference V=DIR [--reference V=DIR ...]
    python vllm_driver.py generate --namespace NS --name ACTOR
    python vllm_driver.py train --namespace NS --config C --seed S --version V
    python vllm_driver.py down --namespace NS

``up``: the demo's Megatron-layout sources (detached, seeded weights of V), ONE detached
``VllmReplica`` named ``<D>r0`` (TP 1, dummy weights) that discovery finds by its prefix, and
one reference engine per ``--reference`` (the same vLLM loaded normally from that checkpoint),
all started together; then the greedy generation of the dummy engine and of every reference (and
the references' kernel checksums: the reference cache's entry), after which the references are
stopped. ``down`` stops every engine (its processes first) and
kills every actor of the namespace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.support, run as a script

import ray

from sync_runtime.core.topology import Role
from sync_runtime.testing.cluster import DemoSetup, create_participants, train_step
from tests.support.vllm_deploy import engine_env, generations, kernel_checksums, stop_replicas

ENGINE_READY_S = 500.0
"""vLLM start on a loaded 2-core machine (2-3 engines starting together, each importing torch)."""


def _replica(name: str, namespace: str, model_dir: str, load_format: str, detached: bool) -> Any:
    from sync_runtime.engines.vllm_replica import VllmReplica, replica_options

    options = replica_options(name, namespace, 1, engine_env(1))
    if detached:
        options["lifetime"] = "detached"  # outlives this driver, like a serving deployment's actor
    return ray.remote(VllmReplica).options(**options).remote(model_dir, load_format=load_format)


def _setup(args: argparse.Namespace) -> DemoSetup:
    return DemoSetup.create(
        args.config,
        args.src,
        "tp=1,replicas=1",
        namespace=args.namespace,
        seed=args.seed,
        dst_prefix=args.dst_prefix,
    )


def cmd_up(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    setup = _setup(args)
    dst = _replica(f"{args.dst_prefix}r0", args.namespace, str(Path(args.config).parent), "dummy", True)
    refs = {}
    for item in args.reference:
        version, _, directory = item.partition("=")
        refs[version] = _replica(f"reference-{version}", args.namespace, directory, "auto", False)
    engines = [dst, *refs.values()]
    create_participants(
        setup,
        src_version=args.version,
        dst_version="-",
        detached=True,
        skip=lambda c: c.role is Role.DESTINATION,  # the destination is the vLLM replica
    )
    sources_s = time.monotonic() - t0
    ray.get([h.ws_num_ranks.remote() for h in engines], timeout=ENGINE_READY_S)
    engines_s = time.monotonic() - t0
    rows = generations(engines)
    label = ray.get(dst.weight_version.remote())
    kernels = {v: kernel_checksums(h) for v, h in refs.items()}  # what the reference cache keeps
    stop_replicas(list(refs.values()))
    return {
        "dummy": rows[0],
        "reference": {v: {"calls": [r], "kernels": kernels[v]} for v, r in zip(refs, rows[1:], strict=True)},
        "version": label,
        "seconds": {"sources": sources_s, "engines": engines_s, "total": time.monotonic() - t0},
    }


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    handle = ray.get_actor(args.name, namespace=args.namespace)
    rows = generations([handle])[0]
    return {"rows": rows, "version": ray.get(handle.weight_version.remote())}


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    train_step(_setup(args), args.version)  # every source regenerates the seeded weights of V
    return {"trained": args.version}


def cmd_down(args: argparse.Namespace) -> dict[str, Any]:
    named = ray.util.list_named_actors(all_namespaces=True)
    names = sorted(a["name"] for a in named if a["namespace"] == args.namespace)
    handles = {n: ray.get_actor(n, namespace=args.namespace) for n in names}
    engines = [h for n, h in handles.items() if n.startswith((args.dst_prefix, "reference-"))]
    stop_replicas(engines)  # the engine's processes first: ray.kill alone would orphan them
    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    return {"killed": names}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm_driver.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("up", "generate", "train", "down"):
        p = sub.add_parser(name)
        p.add_argument("--address", required=True)
        p.add_argument("--namespace", required=True)
        p.add_argument("--dst-prefix", default="vllm-")
    for name in ("up", "train"):
        p = sub.choices[name]
        p.add_argument("--config", required=True, help="config.json of the model (a checkpoint dir's)")
        p.add_argument("--src", default="tp=2")
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--version", required=True)
    sub.choices["up"].add_argument("--reference", action="append", default=[], metavar="VERSION=DIR")
    sub.choices["generate"].add_argument("--name", required=True)
    args = parser.parse_args(argv)

    ray.init(address=args.address, namespace=args.namespace, logging_level="WARNING", log_to_driver=False)
    commands = {"up": cmd_up, "generate": cmd_generate, "train": cmd_train, "down": cmd_down}
    out = commands[args.cmd](args)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
