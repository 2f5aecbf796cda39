"""`weightsync demo --source megatron-core`: real Megatron-Core trainer ranks as the source.

The deployment (trainer actors, blank destinations, the bit-for-bit check against
reference.safetensors) is `sync_runtime.testing.megatron_deploy`; this runs it twice (v1, then one
real optimizer step and v2) and prints what happened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.schema.report import SyncResult
from sync_runtime.testing.megatron_deploy import MegatronDeployment, load_reference, save_reference


def run_megatron_demo(args: Any, console: Any) -> int:
    """The demo with `--source megatron-core` (embedded Ray cluster only)."""
    import tempfile
    import time

    from sync_runtime.core.models import load_model_config
    from sync_runtime.testing.cluster import start_local_ray

    started = time.monotonic()
    address = start_local_ray(namespace=args.namespace)
    src = ParallelSpec.parse(args.src)
    out = args.dump or Path(tempfile.mkdtemp(prefix="ws-megatron-"))
    console.print(
        f"[bold]WeightSync demo[/]: megatron-core {src.describe()} -> vllm {args.dst} ({args.model})"
    )
    dep = MegatronDeployment.start(src.world_size, args.namespace, args.src_prefix)
    ok = True
    try:
        built = dep.build(load_model_config(args.model), args.src, args.dst, seed=args.seed)
        console.print(
            f"  {len(dep.trainers)} Megatron-Core trainer ranks ({built[0]['layout']} layout) and "
            f"{len(dep.destinations)} destination ranks ready ({time.monotonic() - started:.1f}s)"
        )
        for version in ("v1", "v2"):
            if version != "v1":
                losses = ray.get([h.step.remote(version) for h in dep.trainers])
                console.print(f"  trained one step (loss {max(x for x in losses if x is not None):.4f})")
            path = out / version / "reference.safetensors"
            save_reference(dep.reference(), path)
            report = dep.sync(version, address, args.timeout)
            succeeded = report.result is SyncResult.SUCCEEDED
            problems = dep.verify(load_reference(path), version) if succeeded else ["sync failed"]
            for line in problems:
                console.print(f"  [red]{line}[/]")
            ok = ok and not problems
            console.print(
                f"  sync {version}: {report.result.value} in {report.seconds:.2f}s, "
                f"{report.moved_bytes} bytes, "
                f"{'bit-exact vs ' + str(path) if not problems else 'NOT verified'}"
            )
    finally:
        dep.close()
        ray.shutdown()
    console.print(
        f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/] in {time.monotonic() - started:.1f}s"
    )
    return 0 if ok else 1
