"""The end-to-end tests' Ray driver: what the tests do to the demo's participants in the suite's
token-authenticated Ray cluster (run with ``RayCluster.env()``; each command prints one JSON line):

    python ray_driver.py participants --namespace NS --model M --src S --dst D --seed N ...
    python ray_driver.py train-step --namespace NS --src-prefix P --seed N --version V
    python ray_driver.py verify --namespace NS --dst-prefix P --model M --dst D --seed N --version V
    python ray_driver.py gate --namespace NS --prefix P --gate-file F   # arm a gate on actors
    python ray_driver.py kill --namespace NS --name ACTOR               # ray.kill one actor
    python ray_driver.py kill-all --namespace NS                        # ...every named one
    python ray_driver.py corrupt --namespace NS --name ACTOR --armed on|off
    python ray_driver.py snapshot --namespace NS --prefix P --model M --dst SPEC --seed S
    python ray_driver.py serve                                          # many commands, one process

``serve`` reads one command per stdin line (a JSON list: the argv of one of the commands above)
and answers each with one stdout line ``@ws-driver {"ok": ..., "out"|"error": ...}``. The tests
keep one such process per cluster: a command then costs a Ray call instead of a Python start, a
torch import and a Ray connect (seconds each on a loaded 2-core machine).

``participants``, ``train-step`` and ``verify`` do what ``weightsync demo --participants-only``,
``--train-step`` and ``--verify-only`` do (the same `sync_runtime.testing.cluster` functions);
the tests still run those CLI forms once each, so the CLI stays covered.
``gate``: each matching actor's transfer engine waits before every round while file F exists
(the engine's ``before_round`` test observer, set as the participant's ``_ws_hooks`` with
``__ray_call__``, so the demo's own participant classes are used unchanged); a rank that
reaches a closed gate touches ``F.<pid>.reached``, so a test knows the transfer is under way
without relying on progress reports.
``snapshot``: submits one call per destination actor that returns its version and tensor
checksums in the same task, prints ``submitted``, then compares every rank bit-exact with the
seeded weights of the version it reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPLY = "@ws-driver "
"""Prefix of a `serve` answer line (anything else a library prints on stdout is not an answer)."""


def _actors(namespace: str, prefix: str) -> list[tuple[str, Any]]:
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    names = sorted(a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith(prefix))
    return [(n, ray.get_actor(n, namespace=namespace)) for n in names]


def _install_gate(actor: Any, gate_file: str, max_wait_s: float) -> bool:
    from sync_runtime.transfer import EngineHooks

    def gate(_round: int) -> None:
        if not os.path.exists(gate_file):
            return
        Path(f"{gate_file}.{os.getpid()}.reached").touch()  # tells the test this rank is mid-transfer
        deadline = time.monotonic() + max_wait_s
        while os.path.exists(gate_file) and time.monotonic() < deadline:
            time.sleep(0.05)

    actor._ws_hooks = EngineHooks(before_round=gate)  # what the participant's ws_run hands its engine
    return True


def _arm_corruption(actor: Any, armed: bool) -> bool:
    """Flip one staged byte right before this rank's commit applies it (after the decision): the
    rank's check of its staging refuses the commit, so its replica ends on two versions."""
    from sync_runtime.testing.faults import flip_first_staged_byte

    actor._ws_before_commit = flip_first_staged_byte if armed else None  # pre-commit observer
    return True


def _state(actor: Any) -> tuple[str | None, dict[str, str], Any]:
    return actor.ws_version(), actor.ws_sha256(), actor.ws_meta().coord


def _setup(args: argparse.Namespace) -> Any:
    from sync_runtime.testing.cluster import DemoSetup

    return DemoSetup.create(
        args.model, args.src, args.dst, namespace=args.namespace, seed=args.seed,
        src_prefix=args.src_prefix, dst_prefix=args.dst_prefix,
    )  # fmt: skip


def cmd_participants(args: argparse.Namespace) -> dict[str, Any]:
    """Detached sources at --version and destinations at --stale-version (they outlive us)."""
    from sync_runtime.testing.cluster import create_participants

    handles = create_participants(
        _setup(args), src_version=args.version, dst_version=args.stale_version, detached=True
    )
    return {"created": len(handles)}


def cmd_train_step(args: argparse.Namespace) -> dict[str, Any]:
    from sync_runtime.testing.cluster import train_step

    train_step(_setup(args), args.version)
    return {"version": args.version}


def cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Problems found (none: every destination rank holds --version bit-exact)."""
    from sync_runtime.testing.cluster import verify_destinations

    return {"problems": verify_destinations(_setup(args), args.version)}


def cmd_gate(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    actors = _actors(args.namespace, args.prefix)
    ray.get([h.__ray_call__.remote(_install_gate, args.gate_file, args.max_wait) for _, h in actors])
    return {"gated": [n for n, _ in actors]}


def cmd_kill(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    ray.kill(ray.get_actor(args.name, namespace=args.namespace), no_restart=True)
    return {"killed": args.name}


def cmd_kill_all(args: argparse.Namespace) -> dict[str, Any]:
    """ray.kill every named actor of the namespace: a module's detached participants would
    otherwise hold their memory (a torch process each) for the rest of the session."""
    import ray

    actors = _actors(args.namespace, "")
    for _, handle in actors:
        ray.kill(handle, no_restart=True)
    return {"killed": [n for n, _ in actors]}


def cmd_corrupt(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    actor = ray.get_actor(args.name, namespace=args.namespace)
    ray.get(actor.__ray_call__.remote(_arm_corruption, args.armed == "on"))
    return {"corrupt": args.name, "armed": args.armed}


def cmd_snapshot(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from sync_runtime.core.topology import ParallelSpec
    from sync_runtime.runtime.hf_manifest import build_manifest
    from sync_runtime.testing.weights import expected_sha256, model_config

    actors = _actors(args.namespace, args.prefix)
    refs = {n: h.__ray_call__.remote(_state) for n, h in actors}
    print("submitted", flush=True)
    manifest = build_manifest(model_config(args.model))
    spec = ParallelSpec.parse(args.dst)
    ranks: dict[str, Any] = {}
    for name, ref in refs.items():
        try:
            version, sums, coord = ray.get(ref, timeout=args.timeout)
        except ray.exceptions.RayActorError as e:
            ranks[name] = {"dead": True, "error": type(e).__name__}
            continue
        want = expected_sha256(manifest, "vllm", spec, coord, args.seed, version)
        ranks[name] = {"version": version, "exact": want == sums, "tensors": len(sums)}
    return {"ranks": ranks}


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "participants": cmd_participants,
    "train-step": cmd_train_step,
    "verify": cmd_verify,
    "gate": cmd_gate,
    "kill": cmd_kill,
    "kill-all": cmd_kill_all,
    "corrupt": cmd_corrupt,
    "snapshot": cmd_snapshot,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray_driver.py", exit_on_error=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--address", required=True)
    for name in COMMANDS:
        p = sub.add_parser(name, exit_on_error=False)
        p.add_argument("--address", required=True)
        p.add_argument("--namespace", required=True)
    for name in ("participants", "train-step", "verify"):
        p = sub.choices[name]
        p.add_argument("--model", default="tiny-llama")
        p.add_argument("--src", default="tp=1")
        p.add_argument("--dst", default="tp=1")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--src-prefix", default="trainer-")
        p.add_argument("--dst-prefix", default="infer-")
    sub.choices["participants"].add_argument("--version", default="v1")
    sub.choices["participants"].add_argument("--stale-version", default="v0")
    for name in ("train-step", "verify"):
        sub.choices[name].add_argument("--version", required=True)
    gate = sub.choices["gate"]
    gate.add_argument("--prefix", required=True)
    gate.add_argument("--gate-file", required=True)
    gate.add_argument("--max-wait", type=float, default=50.0)
    sub.choices["kill"].add_argument("--name", required=True)
    sub.choices["corrupt"].add_argument("--name", required=True)
    sub.choices["corrupt"].add_argument("--armed", choices=("on", "off"), required=True)
    snap = sub.choices["snapshot"]
    snap.add_argument("--prefix", required=True)
    snap.add_argument("--model", required=True)
    snap.add_argument("--dst", required=True)
    snap.add_argument("--seed", type=int, default=0)
    snap.add_argument("--timeout", type=float, default=120.0)
    return parser


def _serve(parser: argparse.ArgumentParser) -> int:
    """One command per stdin line until EOF; one answer line each. A failing command is an
    answer (`ok` false, its traceback), not the end of the server."""
    for line in sys.stdin:
        try:
            args = parser.parse_args(json.loads(line))
            if args.cmd == "serve":
                raise ValueError("serve inside serve")
            answer = {"ok": True, "out": COMMANDS[args.cmd](args)}
        except (Exception, SystemExit):  # argparse still exits on some errors
            answer = {"ok": False, "error": traceback.format_exc()[-4000:]}
        print(REPLY + json.dumps(answer), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    import ray

    # Commands name their namespace; the driver's own only matters for what it creates unnamed.
    namespace = getattr(args, "namespace", "ws-e2e-driver")
    ray.init(address=args.address, namespace=namespace, logging_level="WARNING", log_to_driver=False)
    if args.cmd == "serve":
        return _serve(parser)
    print(json.dumps(COMMANDS[args.cmd](args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
