"""Four settings of the test session's processes: three cut their idle and start-up CPU, one takes
a class of port collisions away; none changes what they compute.

This directory goes on PYTHONPATH for the processes the test session starts (tests/conftest.py;
the e2e's server pods get it in their env), so each imports this module at start-up.

1. vLLM's readers wait for their next message without spinning a core. vLLM's shared-memory
message queue (`vllm.distributed.device_communicators.shm_broadcast`) keeps every reader
busy-looping for one second after each message it reads (`SpinCondition`, `busy_loop_s=1`, no
setting): after every step or RPC each TP worker, and the engine core reading their replies,
holds a core for a second. On a GPU node that buys latency. On the 2-core test machine an engine
serving a client that sends a request every second never stops spinning: the e2e's TP 2 server
pod held both cores for its whole test (about 480 of the suite's 3100 CPU-s), starving the
runtime pod it was being synced by. Measured on a TP 2 engine with ten generations 1.5 s apart:
23.9 CPU-s with vLLM's window, 4.4 CPU-s with this one. The window is shortened when (and only
when) vLLM's module is imported. After the window a reader takes vLLM's own idle path (it
sleeps until the writer's notification, which every write sends), so messages, outputs and
weights are the same: only idle CPU and wake-up latency change. A vLLM whose `SpinCondition` has
no `busy_loop_s` keeps its behaviour (`QUIET_VERSIONS`: the versions read);
tests/engines/test_vllm_quiet.py fails if the window is not applied to the tests' vLLM.

2. The objects a heavy import leaves are frozen out of the garbage collector (`gc.freeze()`, once
each of FREEZE_AFTER has run). Every process here imports torch, most of them vLLM or
Megatron-Core too: about a million long-lived objects (modules, functions, classes) that Python's
collector walks again at each full collection, which the import itself keeps triggering as the
heap grows, and at each of vLLM's explicit `gc.collect()` calls (two in a worker's model load,
one after its KV-cache profiling: 0.3-0.8 s each). Measured with this directory on PYTHONPATH
and without (two runs each): importing vLLM's executor and CPU worker took 12.1 CPU-s, 9.8 with
it, and a `gc.collect()` after it 0.41 s, then 0.0 s; a TP 2 engine's start and first generation
(cgroup cpuacct) 43.9 CPU-s with the quiet window alone, 39.0 with both settings.
vLLM does the same once an engine has started (`freeze_gc_heap`); frozen objects are only never
collected, so a cycle that becomes garbage among them stays in memory (none is expected of a
module's own objects). Objects made after the imports are collected as usual.

3. vLLM's child processes (engine core, TP/PP workers, DP coordinator) are forked where vLLM
itself would fork them on a GPU node: vLLM's default start method is `fork`, and its
`_maybe_force_spawn` keeps `spawn` only in a Ray actor, with CUDA initialized, under WSL or with
`--numa-bind`; its CPU platform instead sets `spawn` for every process. A spawned child imports
torch and vLLM again and rebuilds what its parent had: measured on a TP 2 `vllm.LLM` (tiny Qwen3,
engine core and two workers), start and first generation took 72.7 CPU-s spawned, 24.7 forked,
with the same tokens. This setting keeps every one of vLLM's own reasons for `spawn` and adds one:
a process where Ray is initialized (a Ray driver, such as a test process, or an actor) always
spawns, since its gRPC threads make a fork unsafe. So an engine in a Ray actor spawns its engine
core (the tests' user engines of two or more workers keep the core in a process of its own,
tests/support/vllm_deploy.py's `user_engine_env`, so that the core is their one spawned child),
and that core, `vllm serve` processes and the cores they start fork theirs. test_vllm_plugin's
engine spawns every child (`WS_TEST_VLLM_SPAWN=1`), which keeps vLLM's CPU path, the plugin
loaded by a freshly spawned worker, under test. A forked worker still reads its rank's
settings: vLLM sets each worker's OpenMP threads and binding explicitly at its start
(`init_cpu_threads_env`), not only from the environment. `WS_TEST_VLLM_SPAWN=1` in a process's
environment keeps vLLM's CPU `spawn` there.

4. vLLM's ports come from below the kernel's ephemeral range. vLLM picks the ports of a TP
engine's torch.distributed rendezvous and of its data-parallel coordination by binding port 0
and closing the socket (`network_utils._get_open_port`); the port is bound again seconds later,
once the workers are up. A port from port 0 is one any `connect()` on the machine may take in
between (sync_runtime/testing/ports.py): a Megatron-Core trainer rendezvous of the same kind failed
CI with EADDRINUSE while the other test lane ran. Where vLLM would bind port 0 (no `VLLM_PORT`),
it gets `free_port()`'s port instead; `VLLM_PORT` and vLLM's other calls are left as they are.
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.machinery
import inspect
import multiprocessing
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
START_MODULE = "vllm.utils.system_utils"
KEEP_SPAWN_ENV = "WS_TEST_VLLM_SPAWN"
PORT_MODULE = "vllm.utils.network_utils"
FORK_CHECKS = ("current_platform", "cuda_is_initialized", "in_wsl")
"""The names of vLLM's module that `_fork_is_safe` reads (0.31 and 0.32 have them)."""
BUSY_WINDOW_S = 0.01
QUIET_VERSIONS = ("0.31.", "0.32.")
"""vLLM releases whose `SpinCondition(..., busy_loop_s)` this was read against."""


def _shorten(module: ModuleType) -> None:
    spin = getattr(module, "SpinCondition", None)
    if spin is None or hasattr(spin, "weightsync_test_window_s"):
        return
    if "busy_loop_s" not in inspect.signature(spin.__init__).parameters:
        return
    original = spin.__init__

    def __init__(self: Any, *args: Any, busy_loop_s: float = BUSY_WINDOW_S, **kwargs: Any) -> None:
        original(self, *args, busy_loop_s=min(busy_loop_s, BUSY_WINDOW_S), **kwargs)

    spin.__init__ = __init__
    spin.weightsync_test_window_s = BUSY_WINDOW_S


def _fork_is_safe(system_utils: ModuleType) -> bool:
    """vLLM's own conditions for `fork` (all but its CPU platform's blanket `spawn`), and no Ray:
    Ray initialized covers vLLM's "in a Ray actor" and also a Ray driver."""
    ray = sys.modules.get("ray")
    return (
        os.environ.get(KEEP_SPAWN_ENV) != "1"
        and system_utils.current_platform.is_cpu()
        and not (ray is not None and ray.is_initialized())
        and not system_utils.cuda_is_initialized()
        and not system_utils.in_wsl()
        and "--numa-bind" not in sys.argv
    )


def _fork_children(system_utils: ModuleType) -> None:
    """vLLM's `get_mp_context` returns a `fork` context where `_fork_is_safe`. Patched in the
    module right after it ran, before any vLLM module imports the function by name."""
    original = system_utils.get_mp_context
    if getattr(original, "weightsync_test_fork", False) or not all(
        hasattr(system_utils, name) for name in FORK_CHECKS
    ):
        return  # a vLLM whose module differs keeps its own start method

    def get_mp_context() -> Any:
        context = original()
        if context.get_start_method() == "spawn" and _fork_is_safe(system_utils):
            return multiprocessing.get_context("fork")
        return context

    get_mp_context.weightsync_test_fork = True  # type: ignore[attr-defined]
    system_utils.get_mp_context = get_mp_context


def _ports_below_ephemeral(network_utils: ModuleType) -> None:
    """vLLM's `_get_open_port` draws from sync_runtime.testing.ports where it would bind port 0.
    `get_open_port` and `get_open_ports_list` look it up in the module at each call, so the
    patch reaches them wherever they were imported."""
    original = getattr(network_utils, "_get_open_port", None)
    envs = getattr(network_utils, "envs", None)
    if original is None or envs is None or getattr(original, "weightsync_test_ports", False):
        return  # a vLLM whose module differs keeps its own ports

    def _get_open_port(start_port: int | None = None, max_attempts: int | None = None) -> int:
        if start_port is None and envs.VLLM_PORT is None:
            from sync_runtime.testing.ports import free_port

            return free_port()
        return original(start_port, max_attempts)

    _get_open_port.weightsync_test_ports = True  # type: ignore[attr-defined]
    network_utils._get_open_port = _get_open_port


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds each module of `names` with the normal path finder and calls `then` on it once it
    ran (`key` names the setting: one finder per setting and process)."""

    def __init__(self, key: str, names: frozenset[str], then: Callable[[ModuleType], None]) -> None:
        self.key, self.names, self.then = key, names, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module, then = spec.loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _add_finder(finder: _AfterImport) -> bool:
    """Put `finder` first on sys.meta_path unless one for its setting is there (False then)."""
    if any(isinstance(f, _AfterImport) and f.key == finder.key for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, finder)
    return True


FREEZE_AFTER = frozenset(
    {
        "torch",
        "transformers",
        "ray",
        "megatron.core",
        "vllm.config",
        "vllm.entrypoints.llm",
        "vllm.v1.executor.abstract",
        "vllm.v1.worker.cpu_worker",
        "vllm.model_executor.model_loader",
    }
)
"""Modules after whose import the heap is frozen: the roots of the heavy imports (torch's, vLLM's
configuration and engine, its CPU worker and model loader, transformers', Ray's, Megatron-Core's)."""


def pythonpath_without_this_site(pythonpath: str) -> str:
    """`pythonpath` without this directory: what a process started outside the test session gets
    (the tests that compare the two, and those that need a plain interpreter)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and os.path.abspath(p) != here)


def _when_imported(key: str, name: str, then: Callable[[ModuleType], None]) -> None:
    """`then(module)` at once if module `name` is loaded, else once it is (setting `key`)."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        _add_finder(_AfterImport(key, frozenset({name}), then))


def install() -> None:
    """The settings in this process (idempotent). vLLM's window and start method at once if their
    modules are loaded, else when they are; the heap at once, then after each FREEZE_AFTER
    module still to come."""
    _when_imported("quiet", SHM_MODULE, _shorten)
    _when_imported("fork", START_MODULE, _fork_children)
    _when_imported("ports", PORT_MODULE, _ports_below_ephemeral)
    gc.freeze()
    if _add_finder(_AfterImport("freeze", FREEZE_AFTER, lambda _: gc.freeze())):
        # At exit the objects are handed back to the collector, so that the interpreter's last
        # collection frees them as it would have (nanobind, which some of them hold, reports
        # objects still alive at exit as leaks).
        atexit.register(gc.unfreeze)


install()
