"""An RL post-training loop with WeightSync in-process: train step -> push -> generate.

Runs on one machine against the demo's embedded Ray cluster: Megatron-style source actors
(the "trainer", tp=2) and two vLLM-style destination replicas (tp=2 each) holding synthetic
tiny-llama weights. The "train step" computes new weights on the driver and writes them into
every source actor with `ws_update`; `push` syncs them to every replica and returns the report;
"generate" reads from one replica what it now serves. Prints per-step sync seconds.

    V=$(bash tools/venv.sh); PYTHONPATH=. $V/bin/python examples/rl_loop.py --steps 3
"""

from __future__ import annotations

import argparse
import time

import ray

from sync_runtime.runtime.discovery import find_actors
from sync_runtime.schema.crd import Transport
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    destination_participants,
    kill_participants,
    start_local_ray,
    verify_destinations,
    weightsync_spec,
)
from sync_runtime.testing.weights import bits_to_torch, shard_arrays
from sync_runtime.trainer import InProcessSync, push


def train_step(setup: DemoSetup, version: str) -> None:
    """Stand-in for forward/backward/optimizer.step(): every source rank's shards become the
    weights of `version`, written into the live tensors by the actor's own `ws_update`."""
    actors = [h for _, h in find_actors(setup.namespace, setup.src_prefix)]
    coords = [m.coord for m in ray.get([h.ws_meta.remote() for h in actors])]
    updates = []
    for handle, coord in zip(actors, coords, strict=True):
        arrays = shard_arrays(setup.manifest, "megatron", setup.src, coord, setup.seed, version)
        tensors = {name: bits_to_torch(a) for name, a in arrays.items()}
        updates.append(handle.ws_update.remote(tensors, version))
    ray.get(updates)


def generate(setup: DemoSetup) -> str:
    """Stand-in for rollouts: what replica 0's first rank serves (its version, a weight's norm)."""
    rank0 = destination_participants(setup)[0]
    name = "model.embed_tokens.weight"
    weight = ray.get(rank0.handle.ws_tensor.remote(name))
    served = ray.get(rank0.handle.ws_version.remote())
    return f"{rank0.name} serves {served}, |{name}|={weight.float().norm():.4f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args()

    address = start_local_ray(num_cpus=2)
    setup = DemoSetup.create(args.model, "tp=2", "tp=2,replicas=2", namespace="rl-loop", seed=1)
    create_participants(setup, src_version="step-0", dst_version="stale")
    spec = weightsync_spec(setup, "step-0", address=address, transport=Transport(transfer_timeout_seconds=60))
    try:
        with InProcessSync(spec) as sync:
            push("step-0", sync)  # the initial weights (cold: discovery, plan, process group)
            for step in range(1, args.steps + 1):
                version = f"step-{step}"
                train_step(setup, version)
                t0 = time.monotonic()
                report = push(version, sync)
                wall = time.monotonic() - t0
                print(
                    f"step {step}: synced {report.version} in {report.seconds:.3f}s "
                    f"(push wall {wall:.3f}s, {report.moved_bytes / 1e6:.2f} MB, plan cached: "
                    f"{report.plan_cached}); {generate(setup)}"
                )
            problems = verify_destinations(setup, f"step-{args.steps}")
            print("destinations bit-exact:", problems or "yes")
            return 1 if problems else 0
    finally:
        kill_participants(setup)
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
