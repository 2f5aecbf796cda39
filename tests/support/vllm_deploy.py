"""Test helpers for real vLLM destinations: the package's (sync_runtime.demo.vllm_models,
vllm_deploy) under their old names, with this clone and its tests on the workers' path (a
test's worker extension lives in tests.support).

Runs only under the engine environment (tools/vllm_env.sh); imported by tests/engines only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sync_runtime.demo import vllm_deploy as _deploy
from sync_runtime.demo.vllm_deploy import (
    destination_ref,
    generations,
    rows_equal,
    stop_replicas,
    sync_spec,
    wait_ready,
)
from sync_runtime.demo.vllm_models import CONFIGS, MAX_TOKENS, PROMPTS, write_model

ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "CONFIGS",
    "MAX_TOKENS",
    "PROMPTS",
    "ROOT",
    "destination_ref",
    "engine_env",
    "generations",
    "rows_equal",
    "start_replica",
    "stop_replicas",
    "sync_spec",
    "wait_ready",
    "write_model",
]


def engine_env(tp: int) -> dict[str, str]:
    return _deploy.engine_env(tp, pythonpath=(str(ROOT), str(ROOT / "operator")))


def start_replica(name: str, namespace: str, model_dir: str, *, tp: int, **kw: Any) -> Any:
    return _deploy.start_replica(name, namespace, model_dir, tp=tp, env=engine_env(tp), **kw)
