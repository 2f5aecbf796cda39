"""The test session's vLLM processes use the short idle window of tests/support/session_site and
have the heavy imports frozen out of the garbage collector (why: its sitecustomize.py): a process
started with the session's environment, as every engine process the tests start is, gets both;
one started without that directory keeps vLLM's own second and freezes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.session_site import sitecustomize as quiet

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

PROBE = """
import gc, inspect, json, vllm
from vllm.distributed.device_communicators import shm_broadcast as shm
print(json.dumps({
    "version": vllm.__version__,
    "frozen": gc.get_freeze_count(),
    "marked": getattr(shm.SpinCondition, "weightsync_test_window_s", None),
    "default": inspect.signature(shm.SpinCondition.__init__).parameters["busy_loop_s"].default,
}))
"""


def _probe(pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_processes_of_the_session_wait_quietly_and_others_do_not() -> None:
    session = _probe(os.environ["PYTHONPATH"])
    assert session["version"].startswith(quiet.QUIET_VERSIONS), session
    assert session["marked"] == quiet.BUSY_WINDOW_S
    assert session["default"] == quiet.BUSY_WINDOW_S
    assert session["frozen"] > 100_000  # torch's and vLLM's objects, out of every collection

    # control: without the directory on PYTHONPATH vLLM keeps its one-second window
    plain = _probe(quiet.pythonpath_without_this_site(os.environ["PYTHONPATH"]))
    assert plain["marked"] is None and plain["default"] == 1
    assert plain["frozen"] < session["frozen"] // 100  # (CPython 3.12 starts with a few hundred of its own)
