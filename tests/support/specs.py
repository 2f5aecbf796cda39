"""WeightSync specs for unit tests of `vllmServers` destinations."""

from __future__ import annotations

from typing import Any

from sync_runtime.schema.crd import WeightSyncSpec


def spec_with_destination(destination: dict[str, Any]) -> WeightSyncSpec:
    """A spec of version v1 from a Megatron-layout Ray source to the one `destination` given."""
    return WeightSyncSpec.model_validate(
        {
            "version": "v1",
            "source": {
                "name": "trainer",
                "rayAddress": "10.0.0.1:6379",
                "actorPrefix": "t-",
                "layout": "megatron",
                "authSecretRef": {"name": "ray"},
            },
            "destinations": [destination],
        }
    )


def servers_spec(parallelism: dict[str, int], dp: int) -> WeightSyncSpec:
    """A spec whose one destination is vLLM server pods (`app=vllm`) of `dataParallelSize` dp."""
    servers = {"selector": {"matchLabels": {"app": "vllm"}}, "dataParallelSize": dp}
    return spec_with_destination(
        {"name": "rollout", "layout": "vllm", "vllmServers": servers, "parallelism": parallelism}
    )
