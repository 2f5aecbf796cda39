"""Typed models of the WeightSync custom resource (CRD `weightsyncs.weightsync.io`, v1alpha1).

The operator and the runtime share these models and the runtime's report (report.py), nothing
else. The wire format is camelCase; Python attributes are snake_case; the translation happens
here, once (`WeightSyncSpec.model_validate(body["spec"])`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from sync_runtime.topology import ParallelSpec

GROUP = "weightsync.io"
VERSION = "v1alpha1"
PLURAL = "weightsyncs"
KIND = "WeightSync"


class CrdModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class SecretKeyRef(CrdModel):
    name: str
    key: str = "token"


class Parallelism(CrdModel):
    """Expected parallelism of a deployment; discovery checks the real actors against it."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    vpp: int = Field(1, ge=1)
    replicas: int = Field(1, ge=1)
    layer_counts: list[int] | None = None

    def to_spec(self) -> ParallelSpec:
        return ParallelSpec(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            ep=self.ep,
            etp=self.etp,
            vpp=self.vpp,
            replicas=self.replicas,
            layer_counts=tuple(self.layer_counts) if self.layer_counts else None,
        )


class DeploymentRef(CrdModel):
    """Where a model deployment's participant actors live and how they are sharded."""

    name: str
    ray_address: str | None = None
    """Ray cluster address (host:port of the GCS, or ray://host:10001)."""
    ray_cluster: str | None = None
    """A KubeRay RayCluster in the same namespace, resolved to its head service."""
    ray_namespace: str = "weightsync"
    actor_prefix: str
    """Participants are the named Ray actors whose names start with this prefix."""
    layout: Literal["megatron", "vllm", "hf"]
    parallelism: Parallelism = Parallelism()
    auth_secret_ref: SecretKeyRef | None = None
    """Secret holding the Ray auth token; reaches the runtime only as a secretKeyRef env var."""


class Transport(CrdModel):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    bucket_mb: int = Field(64, ge=1, le=4096)
    staging_budget_mb: int = Field(512, ge=2, le=65536)
    max_fan_in: int = Field(4, ge=1, le=64)
    relay: Literal["off", "auto", "on"] = "off"
    connect_timeout_seconds: int = Field(120, ge=1)
    transfer_timeout_seconds: int = Field(300, ge=1)


class RetryPolicy(CrdModel):
    limit: int = Field(3, ge=0)
    backoff_seconds: int = Field(10, ge=0)
    max_backoff_seconds: int = Field(300, ge=0)


class RuntimeOverrides(CrdModel):
    image: str | None = None
    resources: dict | None = None
    service_account_name: str | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict] | None = None
    env: list[dict] | None = None


class WeightSyncSpec(CrdModel):
    source: DeploymentRef
    destinations: list[DeploymentRef] = Field(min_length=1)
    version: str
    model: str | None = None
    """Preset name or path of a config.json inside the runtime image; None = read from the source actors."""
    transport: Transport = Transport()
    retry: RetryPolicy = RetryPolicy()
    runtime: RuntimeOverrides = RuntimeOverrides()
