"""`make test-gpu`: a planned sync between real rank processes on CUDA, checked and timed.

One source rank and one destination rank (two processes) run the planner's plan of a Llama model
with the transfer engine, once per destination staging policy (`device`, then `host`: pinned host
memory). Every committed tensor must equal the seeded weights bit for bit, and its checksum
computed on the device must equal the checksum of the same bytes copied to the CPU. The same
bytes then go once more as one plain `torch.distributed` send/recv: the report gives both rates.

NCCL needs one device per rank (it refuses two ranks on one GPU: "Duplicate GPU detected"), so
with a single CUDA device the ranks keep their tensors on that device and talk over gloo; the
report says which backend ran. `--cpu` runs the same script over gloo without CUDA (`make test`
does, through tests/test_gpu_check.py). Writes one JSON report; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sync_runtime.core.topology import Role
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.testing.scenario import Scenario, mismatches, rank_tensors
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan
from sync_runtime.transfer.checksum import checksum_tensor

DEFAULT_OUT = Path.home() / ".cache" / "weightsync" / "gpu_check" / "report.json"
SIZES = {"small": (256, 2, 4096), "large": (2048, 8, 32000)}
"""(hidden, layers, vocab): `small` is ~10 MB (the --cpu default), `large` ~1 GB of bf16."""
POLICIES = ("device", "host")


def model(size: str) -> dict[str, Any]:
    hidden, layers, vocab = SIZES[size]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": hidden // 16, "vocab_size": vocab, "tie_word_embeddings": False,
    }  # fmt: skip


def placement(ctx: RankContext, cpu: bool) -> tuple[str, torch.device]:
    """(backend, device of this rank's tensors)."""
    if cpu:
        return "gloo", torch.device("cpu")
    count = torch.cuda.device_count()
    if count >= ctx.world_size:
        return "nccl", torch.device("cuda", ctx.rank)
    return "gloo", torch.device("cuda", 0)


def _sync(ctx: RankContext, scenario: Scenario, policy: str, cpu: bool) -> dict[str, Any]:
    backend, device = placement(ctx, cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plan, manifest = scenario.plan(), scenario.manifest()
    role, shard = scenario.shard(ctx.rank)
    group = SyncGroup.connect(
        store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank, world_size=ctx.world_size,
        backend=backend, timeout_s=120.0, group_name=f"{ctx.group_name}-{policy}",
    )  # fmt: skip
    wire_device = str(device) if backend == "nccl" else "cpu"  # NCCL messages live on the GPU
    config = TransferConfig(backend=backend, device=wire_device, staging=policy, timeout_s=120.0)
    on_device = {n: t.to(device) for n, t in rank_tensors(shard, manifest, seed=1).items()}
    dest = None
    if role is Role.DESTINATION:
        stale = {n: t.to(device) for n, t in rank_tensors(shard, manifest, seed=999).items()}
        dest = DestinationWeights(stale, version="v0", policy=policy)  # type: ignore[arg-type]
    sources = on_device if role is Role.SOURCE else None
    seconds, result = 0.0, None
    for version in ("v1", "v1-again"):  # the first sync warms up buffers and connections: time the second
        if dest is not None:
            dest.begin(version)
        start = time.perf_counter()
        result = run_rank_plan(
            group, plan.for_rank(ctx.rank), sources=sources, destination=dest, config=config
        )
        seconds = time.perf_counter() - start
        if dest is not None and result.ok:
            dest.commit()
    assert result is not None
    out: dict[str, Any] = {"rank": ctx.rank, "role": role.value, "ok": result.ok, "seconds": seconds}
    out.update(backend=backend, device=str(device), failure=None if result.ok else str(result.failure))
    if dest is not None and result.ok:
        out.update(_verify(dict(dest.tensors), rank_tensors(shard, manifest, 1)))
    group.close()
    return out


def _verify(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bit-exact against the seeded weights; device checksums equal CPU checksums of the same
    bytes; and a negative control: one flipped bit is seen by both checks."""
    on_cpu = {n: t.cpu() for n, t in live.items()}
    name = max(live, key=lambda n: live[n].numel())
    flipped = live[name].clone()
    flipped.view(-1)[0:1].view(torch.uint8)[0] ^= 1
    return {
        "mismatches": mismatches(on_cpu, want),
        "checksums_differ": [n for n, t in live.items() if checksum_tensor(t) != checksum_tensor(on_cpu[n])],
        "control_caught": bool(mismatches({**on_cpu, name: flipped.cpu()}, want))
        and checksum_tensor(flipped) != checksum_tensor(on_cpu[name]),
        "on_device": sorted({str(t.device) for t in live.values()}),
        "bytes": sum(t.numel() * t.element_size() for t in live.values()),
    }


def _plain(ctx: RankContext, nbytes: int, cpu: bool, repeats: int) -> dict[str, Any]:
    """The same bytes as one tensor, rank 0 -> rank 1, with torch.distributed alone."""
    backend, device = placement(ctx, cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    client = dist.TCPStore(ctx.store_host, ctx.store_port, is_master=False, timeout=timedelta(seconds=120))
    store = dist.PrefixStore(f"plain-{ctx.group_name}", client)
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size)
    wire = device if backend == "nccl" else torch.device("cpu")
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):  # the first round warms up the connection
        dist.barrier()
        start = time.perf_counter()
        if ctx.rank == 0:
            dist.send(buf.to(wire), dst=1)
        else:
            got = torch.empty(nbytes, dtype=torch.uint8, device=wire)
            dist.recv(got, src=0)
            buf.copy_(got)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {"rank": ctx.rank, "seconds": min(times[1:]), "backend": backend}


def check(args: argparse.Namespace) -> dict[str, Any]:
    scenario = Scenario(model(args.size), "tp=1", "tp=1")
    report: dict[str, Any] = {
        "mode": "cpu" if args.cpu else "cuda",
        "cuda_devices": 0 if args.cpu else torch.cuda.device_count(),
        "model": {"size": args.size, "bytes": scenario.manifest().nbytes},
        "torch": torch.__version__,
        "policies": {},
    }
    with LocalWorld(scenario.world_size) as world:
        for policy in POLICIES:
            outcomes = world.run(_sync, [(scenario, policy, args.cpu)] * scenario.world_size, timeout_s=300)
            ranks = [
                o.value if o.value is not None else {"error": o.error, "exitcode": o.exitcode}
                for o in outcomes
            ]
            dst = ranks[1]
            ok = (
                all(r.get("ok") for r in ranks)
                and not dst.get("mismatches")
                and not dst.get("checksums_differ")
            )
            gbps = dst["bytes"] / dst["seconds"] / 1e9 if ok else None
            report["policies"][policy] = {"ok": ok, "gb_per_s": gbps, "ranks": ranks}
        nbytes = report["policies"]["device"]["ranks"][1].get("bytes") or scenario.manifest().nbytes
        plain = world.run(_plain, [(nbytes, args.cpu, 3)] * 2, timeout_s=300)
    if all(o.value is not None for o in plain):
        seconds = plain[1].value["seconds"]
        report["plain_send_recv"] = {"ok": True, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9,
                                     "backend": plain[1].value["backend"]}  # fmt: skip
    else:
        report["plain_send_recv"] = {"ok": False, "errors": [o.error or o.exitcode for o in plain]}
    report["ok"] = all(p["ok"] for p in report["policies"].values()) and report["plain_send_recv"]["ok"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU tensors (no CUDA needed)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (small with --cpu)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu for the gloo form)", file=sys.stderr)
        return 2
    args.size = args.size or ("small" if args.cpu else "large")
    started = time.monotonic()
    report = check(args)
    report["wall_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    rates = {p: v["gb_per_s"] for p, v in report["policies"].items()}
    print(f"gpu_check {report['mode']}: {'OK' if report['ok'] else 'FAILED'}; planned GB/s {rates}; "
          f"plain send/recv GB/s {report['plain_send_recv'].get('gb_per_s')}; report {args.out}")  # fmt: skip
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
