"""CPU seconds per test phase, counted over the pytest process and every process it started.

The suite is CPU-bound (two lanes on CI's two cores keep both about 97% busy), so its wall time
is about its CPU seconds over two, and a test's cost to the suite is the CPU its processes burn,
not its own wall time (which other tests' processes stretch). Wall-clock `--durations` cannot
tell the two apart; this report can, because it counts only this session's processes (Ray's
raylet and workers, vLLM's engine cores and workers, the control plane, CLIs):
- where this process may create a cgroup-v1 `cpuacct` group (root on CI's machine), it moves
  itself into a new one below its own, and every process started from then on is counted, dead
  or orphaned ones too;
- else, the live processes below this one, by their own and their reaped children's times
  (a process that left the tree, killed or re-parented, takes its CPU with it: a phase can then
  read negative).

Off unless `WS_TEST_CPU_REPORT` names a directory (`make test-durations` sets it): each session
writes `<dir>/<pid>.json` ({nodeid: {phase: CPU-s}}) and prints its 15 costliest tests.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, own and reaped children's CPU ticks) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    # fields[1] is the parent; [11:15] are utime, stime, cutime, cstime (proc(5), 0-based from state)
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and of every live process below it (with what they reaped)."""
    children: dict[int, list[int]] = defaultdict(list)
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(entry)) is not None:
            children[found[0]].append(int(entry))
            ticks[int(entry)] = found[1]
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total * TICK_S


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _own_cpuacct_group() -> Path | None:
    """A new cpuacct group below this process's own, with this process moved into it."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            group = CPUACCT / path.lstrip("/") / f"weightsync-tests-{os.getpid()}"
            try:
                group.mkdir()
                (group / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                return None
            return group
    return None


class CpuReport:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.phases: dict[str, dict[str, float]] = defaultdict(dict)
        self.group = _own_cpuacct_group()
        self.start = self.cpu_s()

    def cpu_s(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        return tree_cpu_s(os.getpid())

    def _measure(self, item: pytest.Item, phase: str) -> Iterator[None]:
        before = self.cpu_s()
        yield
        self.phases[item.nodeid][phase] = round(self.cpu_s() - before, 2)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measure(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measure(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measure(item, "teardown")

    def pytest_unconfigure(self) -> None:
        """Back to the parent group; the group goes when no process is left in it."""
        if self.group is not None:
            with contextlib.suppress(OSError):
                (self.group.parent / "cgroup.procs").write_text(str(os.getpid()))
                self.group.rmdir()

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        total = self.cpu_s() - self.start
        how = "cgroup" if self.group is not None else "process tree"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{os.getpid()}.json"
        report = {"session_cpu_s": round(total, 1), "counted_by": how, "tests": self.phases}
        path.write_text(json.dumps(report, indent=1))
        costs = sorted(((sum(p.values()), nodeid) for nodeid, p in self.phases.items()), reverse=True)
        title = f"CPU seconds of this session's processes ({how}): {total:.0f}; the 15 costliest tests"
        terminalreporter.write_sep("=", title)
        for cpu, nodeid in costs[:15]:
            terminalreporter.write_line(f"{cpu:8.1f}s {nodeid}")
        terminalreporter.write_line(f"CPU report: {path}")


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("WS_TEST_CPU_REPORT")
    if out:
        config.pluginmanager.register(CpuReport(Path(out)), "ws-cpu-report")
