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
STAY = "\nimport sys\nprint(flush=True)\nsys.stdin.read()"  # then wait, alive, until stdin closes


def _cpu_of_child(code: str) -> float:
    """The CPU of a child's tree once it did `code`, read while it is still alive."""
    child = subprocess.Popen(
        [sys.executable, "-c", code + STAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        return tree_cpu_s(child.pid)
    finally:
        child.communicate(timeout=30)


def test_a_busy_child_is_counted_and_a_sleeping_one_is_not() -> None:
    # Read the child's own tree: the test session's tree loses processes that end meanwhile.
    busy = _cpu_of_child(BUSY)
    assert busy >= 0.4, busy
    idle = _cpu_of_child("import time; time.sleep(0.5)")
    assert idle < busy / 2, (idle, busy)  # control: wall time alone is not CPU


def test_the_report_counts_a_child_that_ended(tmp_path: Path) -> None:
    report = CpuReport(tmp_path)  # a cgroup where this machine allows one, else the tree
    try:
        if report.group is None:  # no cgroup-v1 cpuacct here (cgroup v2, no root): the tree
            assert report.cpu_s() == pytest.approx(tree_cpu_s(os.getpid()), abs=0.5)
            return
        before = report.cpu_s()
        subprocess.run([sys.executable, "-c", BUSY], check=True)
        assert report.cpu_s() - before >= 0.4
    finally:
        report.pytest_unconfigure()
