"""The test session's vLLM processes use the short idle window of tests/support/session_site, have
the heavy imports frozen out of the garbage collector and fork vLLM's children where vLLM would
and draw vLLM's ports from below the ephemeral range (why: its sitecustomize.py): a process
started with the session's environment, as every engine process the tests start is, gets all
four; one started without that directory keeps vLLM's own second, freezes nothing, spawns as
vLLM's CPU platform asks and takes vLLM's ports from port 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sync_runtime.testing import ports
from tests.support.session_site import sitecustomize as quiet

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

PROBE = """
import gc, inspect, json, sys, types, vllm
from vllm.distributed.device_communicators import shm_broadcast as shm
from vllm.utils import network_utils, system_utils
start = system_utils.get_mp_context().get_start_method()
ports = [network_utils.get_open_port() for _ in range(8)]
ray = types.ModuleType("ray")  # a process where Ray is initialized
ray.is_initialized = lambda: True
sys.modules["ray"] = ray
print(json.dumps({
    "version": vllm.__version__,
    "frozen": gc.get_freeze_count(),
    "marked": getattr(shm.SpinCondition, "weightsync_test_window_s", None),
    "default": inspect.signature(shm.SpinCondition.__init__).parameters["busy_loop_s"].default,
    "start": start,
    "start_with_ray": system_utils.get_mp_context().get_start_method(),
    "ports": ports,
}))
"""


def _probe(pythonpath: str, **extra: str) -> dict:
    # VLLM_WORKER_MULTIPROC_METHOD=spawn: what vLLM's CPU platform sets before starting a child
    env = {**os.environ, "PYTHONPATH": pythonpath, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", **extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_processes_of_the_session_wait_quietly_and_others_do_not() -> None:
    session = _probe(os.environ["PYTHONPATH"])
    assert session["version"].startswith(quiet.QUIET_VERSIONS), session
    assert session["marked"] == quiet.BUSY_WINDOW_S
    assert session["default"] == quiet.BUSY_WINDOW_S
    assert session["frozen"] > 100_000  # torch's and vLLM's objects, out of every collection
    assert session["start"] == "fork" and session["start_with_ray"] == "spawn"
    assert _probe(os.environ["PYTHONPATH"], **{quiet.KEEP_SPAWN_ENV: "1"})["start"] == "spawn"
    low = ports._ephemeral_low()
    assert all(low - ports._SPAN <= p < low for p in session["ports"]), session["ports"]

    # control: without the directory on PYTHONPATH vLLM keeps its one-second window
    plain = _probe(quiet.pythonpath_without_this_site(os.environ["PYTHONPATH"]))
    assert plain["marked"] is None and plain["default"] == 1
    assert plain["start"] == "spawn"
    assert any(p >= low for p in plain["ports"]), plain["ports"]  # vLLM's port 0: the ephemeral range
    assert plain["frozen"] < session["frozen"] // 100  # (CPython 3.12 starts with a few hundred of its own)
