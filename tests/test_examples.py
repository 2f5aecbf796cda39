"""examples/rl_loop.py, the RL loop docs/trainer.md points to, runs as documented.

A real subprocess (its own embedded Ray cluster, real source and destination actors, real
process groups): each step's push must report the step's version, and the destinations must end
bit-exact on the last step's weights (the example checks them against the seeded reference and
exits 1 otherwise). Kept in the suite so the documented example cannot rot.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_rl_loop_example_pushes_every_step_and_ends_bit_exact() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ["PYTHONPATH"]]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = re.findall(r"^step (\d+): synced (\S+) in .* (\S+) serves (\S+),", proc.stdout, re.M)
    assert [(s, v, served) for s, v, _, served in steps] == [
        ("1", "step-1", "step-1"),
        ("2", "step-2", "step-2"),
    ], proc.stdout
    assert "destinations bit-exact: yes" in proc.stdout, proc.stdout
