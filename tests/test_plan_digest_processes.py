"""The plan digest does not depend on the process: two interpreters with different hash seeds
plan the same sync and print the same digest (spawns processes: e2e tier)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

DIGEST_SCRIPT = """
from sync_runtime.core.models import load_model_config
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
m = build_manifest(load_model_config("tiny-qwen3-moe"))
s, d = ParallelSpec.parse("tp=2,pp=2,dp=2,ep=2"), ParallelSpec.parse("tp=2,ep=2,replicas=2")
plan = plan_sync(m, SideSpec("megatron", s, tuple(enumerate_ranks(s, Role.SOURCE))),
                 [SideSpec("vllm", d, tuple(enumerate_ranks(d, Role.DESTINATION)))], PlannerConfig())
print(plan.digest)
"""


def test_digest_is_stable_across_processes() -> None:
    digests = set()
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", DIGEST_SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1, json.dumps(sorted(digests))
