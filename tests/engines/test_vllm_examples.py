"""examples/megatron_to_vllm.py works (docs/integration.md) and uses only the public API.

The example's main() runs in a real subprocess in the engine environment, through
tests/support/megatron_example_oracle.py: the one difference from running the example is that its
checkpoint-loaded oracle engine's outputs come from the reference cache when it holds them for
exactly that oracle (the checkpoint's bytes, the example's engine code and settings, vLLM/torch,
the CPU), and the oracle engine starts only on a miss. Its own Ray cluster, two real
Megatron-Core trainer ranks (tp=2, gloo) registered without names, a real vLLM engine (an
offline `LLM` in the user's own actor) registered with `register_vllm_actor`. It exits 0 only
when, after the sync, greedy generation equals an engine loaded from the trainer's checkpoint
(token ids and every logprob bit) and differed before the sync (dummy weights, the negative
control); the test checks the exit code and both lines.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron_to_vllm.py"
RUNNER = ROOT / "tests" / "support" / "megatron_example_oracle.py"
ORACLE_LINE = re.compile(r"^oracle: reference cache (hit|miss|refused) \((.*)\): (\S+\.json)$", re.M)
NOT_PUBLIC = ("sync_runtime.demo", "sync_runtime.testing", "tests")

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]


def test_the_example_imports_only_the_public_api() -> None:
    tree = ast.parse(EXAMPLE.read_text())
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "sync_runtime.runtime.registry" in modules and "sync_runtime.trainer" in modules
    bad = [m for m in modules if m.split(".")[0] == "tests" or m.startswith(NOT_PUBLIC[:2])]
    assert bad == [], bad


def test_megatron_to_vllm_example_generates_as_the_checkpoint_after_the_sync() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ["PYTHONPATH"]]),
    }
    proc = subprocess.run(
        [sys.executable, str(RUNNER)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=850
    )
    out = proc.stdout
    print(out[-3000:])
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-5000:]
    oracle = ORACLE_LINE.search(out)
    assert oracle is not None, out
    print(oracle[0])  # hit or miss, for the log (Ray's workers' lines fill the output's tail)
    assert Path(oracle[3]).is_file()  # a hit, or a miss stored
    assert re.search(r"^synced step-0: [1-9][\d.]* MB in ", out, re.M), out
    assert "before the sync: 0/4 prompts generate as the checkpoint" in out, out
    assert "after the sync: generation equals the checkpoint-loaded engine: yes" in out, out
