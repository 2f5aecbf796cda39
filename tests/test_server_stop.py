"""`vllm_server.stop` returns only once the server's whole process group is gone: vLLM's engine
core and workers can outlive the API server by a moment, and a demo or test that returned before
them left a worker running (seen once in test_vllm_server_demo)."""

from __future__ import annotations

import subprocess
import time

import pytest

from sync_runtime.testing.vllm_server import _group_alive, stop

pytestmark = pytest.mark.e2e

# The leader exits at once on SIGTERM; its child ignores SIGTERM and lives 1.5 s more.
GROUP = "(trap '' TERM; sleep 1.5) & trap 'exit 0' TERM; while true; do sleep 0.1; done"


def test_stop_waits_for_every_process_of_the_group() -> None:
    proc = subprocess.Popen(["bash", "-c", GROUP], start_new_session=True)
    time.sleep(0.5)  # the child is up
    assert _group_alive(proc.pid)
    stop(proc)
    assert proc.returncode is not None and not _group_alive(proc.pid)


def test_a_group_gone_already_is_not_alive() -> None:
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    assert not _group_alive(proc.pid)
