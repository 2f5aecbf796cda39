"""Shared fixtures of the real-engine tests: one local Ray cluster for the whole session; the
session's reference-cache lookups in the terminal summary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from sync_runtime.testing.cluster import start_local_ray


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    yield start_local_ray(num_cpus=8)  # actors claim none; more CPUs = more concurrent worker starts
    ray.shutdown()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How the oracle engines' outputs were found: a warm reference cache starts none of them."""
    from sync_runtime.testing.reference_cache import STATS, cache_dir

    if STATS:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(STATS.items()))
        terminalreporter.write_line(f"reference cache ({cache_dir()}): {counts}")
