"""Register a user's own vLLM actor as a WeightSync destination replica, without renaming it.

    register_vllm_actor("rollout", engine_actor, namespace="rl", replica=0)

`engine_actor` is a Ray actor the user wrote that holds a `vllm.LLM` or an `AsyncLLM` started
with `weight_transfer_config={"backend": "weightsync"}` (engines/vllm_actor.py, `ActorControl`:
the engine is its one such attribute, or the attribute named by `attr`; an `AsyncLLM`'s actor
exposes the `weightsync` adapter method). WeightSync starts one
`VllmEngineRanks` actor next to it, unnamed and owned by the caller, which speaks the rank
protocol and drives the engine through vLLM's weight-transfer calls; that actor is registered
for the deployment (runtime/registry.py), so discovery finds the engine's ranks by the
deployment's name. A source needs no helper: its actor calls `register(deployment,
namespace=...)` itself (see docs/integration.md).
"""

from __future__ import annotations

from typing import Any

import ray

from sync_runtime.engines.vllm_actor import ActorControl
from sync_runtime.engines.vllm_ranks import VllmEngineRanks
from sync_runtime.runtime.registry import register

MAX_RANKS = 8
"""Concurrency the ranks actor is sized for (one engine's TP workers)."""


def register_vllm_actor(
    deployment: str,
    engine_actor: Any,
    *,
    namespace: str,
    replica: int = 0,
    attr: str | None = None,
    pause: str = "keep",
    ready_timeout_s: float = 300.0,
) -> Any:
    """Attach WeightSync to the vLLM engine inside `engine_actor`, register it as replica `replica`
    of `deployment` in Ray namespace `namespace`, and return the ranks actor's handle (keep it:
    the ranks actor lives as long as its owner, the caller's process)."""
    ranks = (
        ray.remote(VllmEngineRanks)
        .options(num_cpus=0, max_concurrency=4 * MAX_RANKS + 4)
        .remote(ActorControl(engine_actor, attr), replica=replica, pause=pause)
    )
    ray.get(ranks.ws_num_ranks.remote(), timeout=ready_timeout_s)  # surfaces a constructor error
    register(deployment, ranks, namespace=namespace, names=[f"{deployment}-r{replica}"])
    return ranks


__all__ = ["register_vllm_actor"]
