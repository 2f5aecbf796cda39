"""Kubernetes path overhead of a trainer's push: patch of spec.version -> `Synced` seen by the
trainer's watch, minus the runtime's own sync seconds (its report), tiny model, warm runtime.

It runs the e2e test that measures it (tests/e2e/test_trainer_push.py::
test_overhead_of_the_kubernetes_path) under pytest, so the figure comes from exactly the e2e
setup, built by the same fixtures: the control plane of tests/k8s/controlplane.py (etcd,
kube-apiserver, controller-manager on loopback), the test node agent, a token-authenticated
Ray cluster with the demo's tiny-llama actors (megatron tp=2 -> vllm tp=2 x2), and the
Helm-installed operator with its runtime pod. One warm-up push, then --pushes measured ones.

    make bench-k8s                      # median of 5
    make bench-k8s ARGS="--pushes 9"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/e2e/test_trainer_push.py::test_overhead_of_the_kubernetes_path"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=5, help="measured pushes after one warm-up")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        env = {**os.environ, "WS_PUSH_BENCH_N": str(args.pushes), "WS_PUSH_BENCH_JSON": str(out)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "e2e", "-p", "no:cacheprovider", TEST]
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
        if proc.returncode != 0 or not out.exists():
            print(f"bench-k8s: the measuring test failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        data = json.loads(out.read_text())
    rows = data["pushes"]
    print(f"\n{'push':>4} {'patch->Synced s':>16} {'runtime sync s':>15} {'overhead s':>11}")
    for i, r in enumerate(rows):
        print(f"{i:>4} {r['wall_s']:>16.3f} {r['runtime_s']:>15.3f} {r['overhead_s']:>11.3f}")
    overheads = [r["overhead_s"] for r in rows]
    print(
        f"Kubernetes path overhead (tiny-llama, warm runtime): median {statistics.median(overheads):.3f}s, "
        f"min {min(overheads):.3f}s, max {max(overheads):.3f}s over {len(rows)} pushes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
