"""Session-wide test setup: every test belongs to exactly one tier, and the setups that cost
seconds to start (a local Ray cluster, a pool of rank processes) are shared by the tests that
need one but not their isolation.

Tiers (markers registered in pyproject.toml; `make test-unit`, `test-e2e`, `test-engines`):
``unit`` pure and in-process; ``e2e`` spawns processes (Ray, rank pools, the control plane, CLIs);
``engines`` real vLLM or Megatron-Core. A test with none, or more than one, fails collection.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SESSION_SITE = str(Path(__file__).parent / "support" / "session_site")
"""On PYTHONPATH for every process the session starts: vLLM's readers stop spinning a core for a
second after each message, and heavy imports are frozen out of the garbage collector (why, and
what it changes: its sitecustomize.py)."""
os.environ["PYTHONPATH"] = os.pathsep.join(
    dict.fromkeys([SESSION_SITE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
)
from tests.support.session_site import sitecustomize as _session_site  # noqa: E402

_session_site.install()  # the session's own process too (it started before PYTHONPATH changed)

from sync_runtime.testing import reference_cache  # noqa: E402
from tests.support.eager import EAGER_HELPERS  # noqa: E402

os.environ.update(EAGER_HELPERS)  # every process the session starts: why in tests/support/eager.py

PYCACHE = reference_cache.cache_root() / "pycache"
"""Where the session's processes keep their bytecode, outside the clone in the project's cache
folder, as the environments are.
Where the environment asks for none (PYTHONDONTWRITEBYTECODE=1, as on this project's CI machine),
every process the session starts (Ray workers, rank processes, vLLM's engine processes: hundreds
a run) compiled the project's modules again as it imported them: importing the coordinator, the
transfer, the CLI and the test actors took 4.2 CPU-s so, 3.0 from bytecode. Python checks each
file's source (mtime and size) before it uses its bytecode, so an edit is never run stale."""
os.environ["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.pycache_prefix, sys.dont_write_bytecode = str(PYCACHE), False  # this process's own imports

IPC_DIR = tempfile.mkdtemp(prefix="ws-test-ipc-")
"""Where the session's vLLM processes put their IPC sockets (`VLLM_RPC_BASE_PATH`; vLLM's default
is the system's temporary folder), removed with the session: an engine killed outright (a fault
trial, an actor `ray.kill`ed at a module's end) cannot remove its own, and a `make test` run left
about 500 socket files in /tmp."""
os.environ["VLLM_RPC_BASE_PATH"] = IPC_DIR
atexit.register(shutil.rmtree, IPC_DIR, ignore_errors=True)

RAY_LOG_MONITOR = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
"""Every Ray cluster the session starts (its log monitor inherits the starter's environment) looks
for new log files every 0.5 s instead of every 0.1 s. Ray's log monitor globs the session's log
folder on each pass of its loop until the folder holds 1000 files, and a test session's cluster
starts hundreds of workers: measured on a cluster that had started 60 workers, with 8 of them
printing a line every 0.5 s, it used 3.9 CPU-s a minute with Ray's default and 2.2 with this (the
vLLM lane's cluster used 33 CPU-s over its 24 minutes). Worker output still reaches the log files
and the monitor; the tests start Ray with `log_to_driver=False` and read no worker output through it."""
os.environ.update(RAY_LOG_MONITOR)

pytest_plugins = ["tests.support.cpu_report"]

TIERS = ("unit", "e2e", "engines")
LOCAL_POOL_SIZE = 6
"""Ranks of the shared local pool: the largest world of the tests that share it."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked test must not just vanish
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier marker'}")
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) need exactly one tier marker ({', '.join(TIERS)}; "
            "`pytestmark = pytest.mark.unit` in the module):\n" + "\n".join(wrong)
        )


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ray(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test is pure and in-process: one that would start or join a Ray cluster (`ray.init`,
    also Ray's implicit one, e.g. under `ray.kill` or `ray.get`) fails, naming the tier."""
    if request.node.get_closest_marker("unit") is None:
        return
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a unit test started Ray: stand in for it, or mark the test e2e")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session")
def local_ray() -> Iterator[str]:
    """One embedded Ray cluster for the session (address). Tests create their participants in
    their own namespaces and kill them when done; actors claim no CPUs."""
    import ray

    from sync_runtime.testing.cluster import start_local_ray

    yield start_local_ray(num_cpus=2)
    ray.shutdown()


@pytest.fixture(scope="session")
def _shared_pool() -> Iterator[list]:
    holder: list = []
    yield holder
    for world in holder:
        world.close()


@pytest.fixture
def rank_pool(_shared_pool: list) -> Iterator:
    """A pool of LOCAL_POOL_SIZE local rank processes shared by the session's transfer tests (a
    test uses ranks 0..n-1). A rank that died (a fault test's `os._exit`) is replaced before the
    next test: only that process starts again, not the pool."""
    from sync_runtime.testing.local_ranks import LocalWorld

    if not _shared_pool:
        _shared_pool.append(LocalWorld(LOCAL_POOL_SIZE))
    _shared_pool[0].revive()
    yield _shared_pool[0]
