"""tests/support/cpu_report.py counts the CPU of the processes a test starts, not its wall time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cpu_report import CpuReport, tree_cpu_s

pytestmark = pytest.mark.e2e  # it starts a process

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"


def test_a_child_process_cpu_is_counted_and_a_sleeping_one_is_not() -> None:
    before = tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", BUSY], check=True)
    busy = tree_cpu_s(os.getpid()) - before
    assert busy >= 0.4, busy

    before = tree_cpu_s(os.getpid())
    subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"], check=True)
    idle = tree_cpu_s(os.getpid()) - before
    assert idle < busy / 2, (idle, busy)  # control: wall time alone is not CPU


def test_the_report_counts_the_same_way(tmp_path: Path) -> None:
    report = CpuReport(tmp_path)  # a cgroup where this machine allows one, else the tree
    try:
        before = report.cpu_s()
        subprocess.run([sys.executable, "-c", BUSY], check=True)
        assert report.cpu_s() - before >= 0.4
    finally:
        report.pytest_unconfigure()
