"""`weightsync run --config ws.yaml`: the one-shot runtime as a separate process joining the
test's Ray cluster (token auth: the token arrives only through the operator's env var), plus
the long-lived loop's "already at this version" path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import SecretKeyRef, ray_token_env_name
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    kill_participants,
    verify_destinations,
    weightsync_spec,
)

pytestmark = pytest.mark.e2e

EXE = Path(sys.executable).parent / "weightsync"


@pytest.fixture(scope="module")
def deployment(local_ray: str):
    address = local_ray
    setup = DemoSetup.create("tiny-llama", "tp=2", "tp=1,replicas=2", namespace="t-cli", seed=11)
    create_participants(setup, src_version="v1", dst_version="v0")
    yield address, setup
    kill_participants(setup)


def _write_spec(tmp_path: Path, address: str, setup: DemoSetup, **changes) -> Path:
    spec = weightsync_spec(setup, "v1", address=address)
    source = spec.source.model_copy(update={"auth_secret_ref": SecretKeyRef(name="ray-token")})
    spec = spec.model_copy(update={"source": source, **changes})
    doc = {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "metadata": {"name": "t"},
        "spec": spec.model_dump(by_alias=True, exclude_none=True),
    }
    path = tmp_path / "ws.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    """No token file and no RAY_AUTH_* variables: only the operator's env var carries the token."""
    token_file = Path.home() / ".ray" / "auth_token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    if token_file.is_file():
        env["HOME"] = str(tmp_path)
        env[ray_token_env_name(0)] = token_file.read_text().strip()
    return env


def _run(tmp_path: Path, config: Path) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [str(EXE), "run", "--config", str(config), "--report", str(out)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stderr


def test_run_config_one_shot(deployment, tmp_path):
    address, setup = deployment
    # spec.model unset: the runtime builds the manifest from the config the source actors report.
    rc, report, stderr = _run(tmp_path, _write_spec(tmp_path, address, setup, model=None))
    assert rc == 0, stderr[-3000:]
    assert report["result"] == "Succeeded" and report["version"] == "v1"
    assert report["movedBytes"] == report["plannedBytes"] > 0
    assert verify_destinations(setup, "v1") == []
    token = _env(tmp_path).get(ray_token_env_name(0))
    if token:
        assert token not in stderr  # never logged
    progress = [json.loads(line) for line in stderr.splitlines() if line.startswith('{"version"')]
    assert {p["step"] for p in progress} >= {"discover", "plan", "connect", "transfer", "commit"}


def test_run_config_failure_exits_1(deployment, tmp_path):
    address, setup = deployment
    spec = weightsync_spec(setup, "v1", address=address)
    wrong = spec.destinations[0].model_copy(update={"actor_prefix": "nobody-"})
    rc, report, _ = _run(tmp_path, _write_spec(tmp_path, address, setup, destinations=[wrong]))
    assert rc == 1
    assert report["result"] == "Failed" and report["failure"]["reason"] == "DiscoveryFailed"
    assert "'nobody-'" in report["failure"]["message"] and report["failure"]["step"] == "discover"


def test_already_current_version_moves_nothing(deployment):
    address, setup = deployment
    coordinator = Coordinator(
        weightsync_spec(setup, "v1", address=address), NullReporter(), manifest=setup.manifest
    )
    first = coordinator.sync("v1")
    assert first.result is SyncResult.SUCCEEDED
    again = coordinator.sync("v1", skip_if_current=True)
    assert again.result is SyncResult.SUCCEEDED and again.moved_bytes == 0 and again.stages.transfer == 0
    coordinator.close()


def test_restarted_runtime_builds_a_fresh_group(deployment):
    """A runtime that dies without closing leaves participants holding a healthy-looking group
    whose store is gone; the next runtime must not reuse it."""
    import gc

    address, setup = deployment
    spec = weightsync_spec(setup, "v1", address=address)
    first = Coordinator(spec, NullReporter(), manifest=setup.manifest)
    assert first.sync("v1").result is SyncResult.SUCCEEDED
    del first  # no close(): its TCPStore goes away with it, like a crashed runtime pod
    gc.collect()
    second = Coordinator(spec, NullReporter(), manifest=setup.manifest)
    report = second.sync("v1")
    assert report.result is SyncResult.SUCCEEDED, report.failure
    assert not report.plan_cached and report.stages.connect > 0
    assert verify_destinations(setup, "v1") == []
    second.close()
