"""Ray driver of tests/e2e/test_vllm_e2e.py: the sources and the oracle engines in the e2e Ray cluster.

Runs in a subprocess with the cluster's ``env()`` (token auth) under the engine environment's
Python; each subcommand connects, acts, prints one JSON line and exits. A subprocess, not the
pytest process: in ``make test-engines`` the pytest process is already a driver of the engine
tests' own (unauthenticated) local cluster, and one process joins one Ray cluster.

    python vllm_driver.py up --namespace NS --config C --seed S --version V --src P \
        --reference V=DIR [--reference V=DIR ...] [--reference-tp N]
    python vllm_driver.py train --namespace NS --config C --seed S --version V
    python vllm_driver.py down --namespace NS

``up``: the demo's Megatron-layout sources (detached, seeded weights of V) and one reference
engine per ``--reference`` (a ``VllmReplica``: vLLM loaded normally from that checkpoint), all
started together; then the greedy generation of every reference and its kernel checksums (the
reference cache's entry), after which the references are stopped. The destination is not
here: it is the test's ``vllm serve`` pods, which the runtime attaches by label. ``down`` stops
any reference engine left (its processes first) and kills every actor of the namespace.
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
from tests.support.vllm_deploy import generations, kernel_checksums, start_replica, stop_replicas

ENGINE_READY_S = 500.0
"""vLLM start on a loaded 2-core machine (the server pod and 0-2 references starting together)."""


def _setup(args: argparse.Namespace) -> DemoSetup:
    return DemoSetup.create(
        args.config,
        args.src,
        "tp=1,replicas=1",
        namespace=args.namespace,
        seed=args.seed,
        dst_prefix="unused-",  # the destination is server pods, not actors
    )


def cmd_up(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    setup = _setup(args)
    refs = {}
    for item in args.reference:
        version, _, directory = item.partition("=")
        refs[version] = start_replica(
            f"reference-{version}", args.namespace, directory, tp=args.reference_tp, load_format="auto"
        )
    create_participants(
        setup,
        src_version=args.version,
        dst_version="-",
        detached=True,
        skip=lambda c: c.role is Role.DESTINATION,  # the destination is the vLLM server pods
    )
    sources_s = time.monotonic() - t0
    ray.get([h.ws_num_ranks.remote() for h in refs.values()], timeout=ENGINE_READY_S)
    engines_s = time.monotonic() - t0
    rows = generations(list(refs.values())) if refs else []
    kernels = {v: kernel_checksums(h) for v, h in refs.items()}  # what the reference cache keeps
    stop_replicas(list(refs.values()))
    return {
        "reference": {v: {"calls": [r], "kernels": kernels[v]} for v, r in zip(refs, rows, strict=True)},
        "seconds": {"sources": sources_s, "references": engines_s, "total": time.monotonic() - t0},
    }


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    train_step(_setup(args), args.version)  # every source regenerates the seeded weights of V
    return {"trained": args.version}


def cmd_down(args: argparse.Namespace) -> dict[str, Any]:
    named = ray.util.list_named_actors(all_namespaces=True)
    names = sorted(a["name"] for a in named if a["namespace"] == args.namespace)
    handles = {n: ray.get_actor(n, namespace=args.namespace) for n in names}
    engines = [h for n, h in handles.items() if n.startswith("reference-")]
    stop_replicas(engines)  # the engine's processes first: ray.kill alone would orphan them
    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    return {"killed": names}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm_driver.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("up", "train", "down"):
        p = sub.add_parser(name)
        p.add_argument("--address", required=True)
        p.add_argument("--namespace", required=True)
    for name in ("up", "train"):
        p = sub.choices[name]
        p.add_argument("--config", required=True, help="config.json of the model (a checkpoint dir's)")
        p.add_argument("--src", default="tp=2")
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--version", required=True)
    sub.choices["up"].add_argument("--reference", action="append", default=[], metavar="VERSION=DIR")
    sub.choices["up"].add_argument("--reference-tp", type=int, default=1, help="the servers' TP")
    args = parser.parse_args(argv)

    ray.init(address=args.address, namespace=args.namespace, logging_level="WARNING", log_to_driver=False)
    commands = {"up": cmd_up, "train": cmd_train, "down": cmd_down}
    out = commands[args.cmd](args)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
