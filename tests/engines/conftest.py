"""Shared fixtures of the real-engine tests: one local Ray cluster for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from sync_runtime.testing.cluster import start_local_ray


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    yield start_local_ray(num_cpus=8)  # actors claim none; more CPUs = more concurrent worker starts
    ray.shutdown()
