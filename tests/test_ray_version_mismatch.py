"""A Ray or Python version that differs between the runtime and the cluster is refused at connect
in one line naming both versions. The refusals are Ray's own: `check_version_info` (what a
driver's `ray.init` runs against the GCS metadata) as Ray Client runs it."""

from __future__ import annotations

import platform

import pytest
import ray
from ray._private.utils import check_version_info

from sync_runtime.runtime.connect import version_mismatch_line

pytestmark = pytest.mark.unit


def test_driver_refusal_becomes_one_line_naming_both_versions() -> None:
    with pytest.raises(RuntimeError) as refused:
        check_version_info({"ray_version": "2.41.0", "python_version": "3.11.9"}, "10.0.0.7:6379")
    assert len(str(refused.value).strip().splitlines()) > 3  # Ray's own text is several lines
    line = version_mismatch_line(refused.value)
    assert line is not None and "\n" not in line
    assert "Ray 2.41.0 (Python 3.11.9)" in line
    assert f"this runtime Ray {ray.__version__} (Python {platform.python_version()})" in line


def test_ray_client_refusal_becomes_one_line() -> None:
    """Ray Client checks the same way, at Python minor level, naming itself as the process."""
    with pytest.raises(RuntimeError) as refused:
        check_version_info(
            {"ray_version": "2.41.0", "python_version": "3.11.9"},
            "Ray Client",
            python_version_match_level="minor",
        )
    line = version_mismatch_line(refused.value)
    assert line is not None and "the cluster runs Ray 2.41.0 (Python 3.11.9)" in line


def test_other_errors_are_not_called_a_mismatch() -> None:
    """Control: a matching cluster raises nothing, and an unrelated error is left alone."""
    check_version_info({"ray_version": ray.__version__, "python_version": platform.python_version()}, "x")
    assert version_mismatch_line(ConnectionError("Could not find any running Ray instance")) is None
