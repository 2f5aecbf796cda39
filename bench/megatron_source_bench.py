"""Source-side cost of a sync on a real Megatron-Core rank, against one training step's compute.

One process (gloo world of 1, TP 1, CPU): build a tiny Megatron-Core model (local spec, seeded),
then measure, in CPU seconds of this process (median of --repeats):
- sync: what a source rank does for a sync apart from the wire: enumerate the live tensors and
  check them against the layout (`MegatronSource`), and pack + checksum every bucket the plan
  sends from this rank (`transfer.buffers.pack_bucket`, the same code a sync runs);
- step: one forward + backward of the same model on a small batch (seq 32, batch 2).
Prints both, their ratio and the process's peak RSS.

    make bench-source                       # tiny-qwen3-moe
    make bench-source ARGS="--model tiny-llama --repeats 7"
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.engines import megatron_cpu


def _init() -> None:
    torch.set_num_threads(1)
    megatron_cpu.install()
    # One rank: an in-process store, no port to find (one found free can be taken by then).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _cpu(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    _init()
    from sync_runtime.engines.megatron import MegatronSource
    from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
    from sync_runtime.testing.megatron_models import build_chunks, init_parallel, megatron_config
    from sync_runtime.testing.megatron_train import batch, forward_backward
    from sync_runtime.transfer.buffers import BufferPool, pack_bucket

    config, spec = load_model_config(args.model), ParallelSpec()
    init_parallel(spec, seed=0)
    chunks = build_chunks(config, megatron_config(config, spec))
    source = MegatronSource(chunks, config)
    dst = ParallelSpec()
    plan = plan_sync(
        source.manifest,
        SideSpec(source.layout, spec, tuple(enumerate_ranks(spec, Role.SOURCE))),
        [SideSpec("vllm", dst, tuple(enumerate_ranks(dst, Role.DESTINATION)))],
        PlannerConfig(),
    )
    sends = [b for rnd in plan.for_rank(0).sends for b in rnd]
    pool, cpu = BufferPool(), torch.device("cpu")

    def enumerate_side() -> dict[str, torch.Tensor]:
        return MegatronSource(chunks, config).tensors

    def pack_side(tensors: dict[str, torch.Tensor]) -> None:
        for bucket in sends:
            out = pack_bucket(bucket, tensors.__getitem__, cpu, pool)
            for msg, pooled in zip(out.messages, out.pooled, strict=True):
                if pooled:
                    pool.put(msg)

    data = batch(int(config["vocab_size"]), seq_len=32)

    def step() -> None:
        for c in chunks:
            c.zero_grad(set_to_none=True)
        forward_backward(chunks, data)

    def sync_side() -> None:
        pack_side(enumerate_side())

    sync_side(), step()  # warm-up: first-touch allocations, lazy imports
    live = enumerate_side()
    sync_s, step_s = _cpu(sync_side, args.repeats), _cpu(step, args.repeats)
    enum_s, pack_s = _cpu(enumerate_side, args.repeats), _cpu(lambda: pack_side(live), args.repeats)
    nbytes = sum(t.numel() * t.element_size() for t in source.tensors.values())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"model {args.model}: {len(source.tensors)} source tensors, {nbytes / 1e6:.2f} MB, "
        f"{len(sends)} buckets"
    )
    print(f"sync (enumerate+check, pack+checksum): {sync_s * 1e3:8.2f} ms CPU")
    print(f"  of which enumerate+check {enum_s * 1e3:.2f} ms, pack+checksum {pack_s * 1e3:.2f} ms")
    print(f"one forward+backward (seq 32, batch 2): {step_s * 1e3:8.2f} ms CPU")
    print(f"ratio sync/step: {sync_s / step_s:.3f}   peak RSS {peak_mb:.0f} MB   (pid {os.getpid()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
