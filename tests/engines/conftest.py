"""Shared fixtures of the real-engine tests: one local Ray cluster for the whole session; the
engines several modules start in the same configuration, shared (tests/support/shared_engines.py:
started once, re-synced by each module, stopped after the last module that uses them); the
session's reference-cache lookups and shared engine starts in the terminal summary."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.testing.cluster import start_local_ray

SHARED = ("deepseek_tp2", "qwen3_server", "qwen3_pair")
"""The shared-engine fixtures below."""


@pytest.hookimpl(trylast=True)  # after `-k`/`-m` deselected: only the modules that will run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests.support.shared_engines import group_modules, note_users

    note_users(items, SHARED)
    group_modules(items, SHARED)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    yield start_local_ray(num_cpus=8)  # actors claim none; more CPUs = more concurrent worker starts
    ray.shutdown()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item) -> None:
    from tests.support.shared_engines import POOL

    POOL.finished(item.nodeid)  # the last test using a shared engine stops it


@pytest.fixture(scope="session")
def shared_engines() -> Iterator[Any]:
    from tests.support.shared_engines import POOL

    yield POOL
    POOL.close()


@pytest.fixture(scope="module")
def deepseek_tp2(
    ray_address: str,
    shared_engines: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    """A dummy-weight DeepSeek-V3 user's engine at TP 2 through the weightsync plugin (a
    `UserEngine` and its `ActorControl` proxy: tests/support/shared_engines.py `SharedReplica`),
    for test_vllm_deepseek and test_vllm_megatron_moe_mla."""
    from tests.support import shared_engines as se

    def start() -> se.SharedReplica:
        directory = tmp_path_factory.mktemp("shared-dsv3")
        return se.start_shared_replica("deepseek_v3", directory, "vllm-shared-ds", "ds-shared-", tp=2)

    with shared_engines.use("deepseek_tp2", start, se.stop_shared_replica, se.replica_alive) as engine:
        yield engine


@pytest.fixture(scope="module")
def qwen3_pair(
    ray_address: str,
    shared_engines: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    """Two dummy-weight Qwen3 user's engines at TP 1 through the weightsync plugin (`UserEngine`s
    attached with `ActorControl` as replicas 0 and 1: tests/support/shared_engines.py
    `SharedPair`) whose workers carry both modules' fault hooks in a test worker extension, off
    until called (tests/support/vllm_pair_faults.py): test_vllm_delta, test_vllm_dense (whose
    last test kills replica 1 and retires the pair)."""
    from tests.support import shared_engines as se
    from tests.support.vllm_pair_faults import EXTENSION

    def start() -> se.SharedPair:
        directory = tmp_path_factory.mktemp("shared-qwen3-pair")
        return se.start_shared_pair(
            "qwen3", directory, "vllm-shared-qwen3", "qwen3-pair-", extension=EXTENSION
        )

    with shared_engines.use("qwen3_pair", start, se.stop_shared_pair, se.pair_alive) as pair:
        yield pair


@pytest.fixture(scope="module")
def qwen3_server(
    ray_address: str,
    shared_engines: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    """A dummy-weight Qwen3 `vllm serve` (TP 1) with its sources at v1 (test_vllm_server,
    test_vllm_server_pause, replica 0 of test_vllm_server_faults)."""
    from tests.support import shared_server as ss

    def start() -> ss.SharedServer:
        return ss.start_shared_server(tmp_path_factory.mktemp("shared-qwen3-server"))

    with shared_engines.use("qwen3_server", start, ss.stop_shared_server, ss.server_alive) as server:
        yield server


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How the oracle engines' outputs were found: a warm reference cache starts none of them."""
    from sync_runtime.testing.reference_cache import STATS, cache_dir
    from tests.support.shared_engines import STARTS

    if STATS:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(STATS.items()))
        terminalreporter.write_line(f"reference cache ({cache_dir()}): {counts}")
    if STARTS:
        starts = ", ".join(f"{k} {v}" for k, v in sorted(STARTS.items()))
        terminalreporter.write_line(f"shared engines started: {starts}")
