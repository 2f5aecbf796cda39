"""WeightSync specs for unit tests of `vllmServers` destinations."""

from __future__ import annotations

from sync_runtime.schema.crd import WeightSyncSpec


def servers_spec(parallelism: dict[str, int], dp: int) -> WeightSyncSpec:
    """A spec whose one destination is vLLM server pods (`app=vllm`) of `dataParallelSize` dp."""
    servers = {"selector": {"matchLabels": {"app": "vllm"}}, "dataParallelSize": dp}
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
            "destinations": [
                {"name": "rollout", "layout": "vllm", "vllmServers": servers, "parallelism": parallelism}
            ],
        }
    )
