"""`make test-gpu`'s script, in its gloo form (`--cpu`), so it never rots on machines without
CUDA: a planned sync between two rank processes with `device` and `host` staging, bit-exact,
checksums agreeing, the flipped-bit control caught, and a plain send/recv of the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_form_writes_a_passing_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["mode"] == "cpu"
    assert set(report["policies"]) == {"device", "host"}
    for policy in report["policies"].values():
        assert policy["ok"] is True and policy["gb_per_s"] > 0
        destination = policy["ranks"][1]
        assert destination["mismatches"] == [] and destination["checksums_differ"] == []
        assert destination["control_caught"] is True
        assert destination["bytes"] == report["model"]["bytes"]
    plain = report["plain_send_recv"]
    assert plain["ok"] is True and plain["bytes"] == report["model"]["bytes"] and plain["gb_per_s"] > 0
