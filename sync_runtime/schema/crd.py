"""Typed models of the WeightSync custom resource (CRD `weightsyncs.weightsync.io`, v1alpha1).

The operator and the runtime share these models and the runtime's report (report.py), nothing
else. The wire format is camelCase; Python attributes are snake_case; the translation happens
here, once (`WeightSyncSpec.model_validate(body["spec"])`, `status.WeightSyncStatus.model_validate(...)`).

Spec rules the API server enforces with CEL (crds/weightsyncs.weightsync.io.yaml) are mirrored by
`spec_problems()`, with the same messages, so the operator and offline tests see what
`kubectl apply` would refuse. The status models live in status.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.errors import RayClusterNotFoundError, RayClusterNotReadyError, RayUnreachableError

GROUP = "weightsync.io"
VERSION = "v1alpha1"
PLURAL = "weightsyncs"
KIND = "WeightSync"
SHORT_NAME = "ws"
API_VERSION = f"{GROUP}/{VERSION}"

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
"""spec.version: a label-like token (commit, step number, tag), at most 63 characters."""
MAX_DESTINATIONS = 16
"""Bounds the CEL uniqueness rule's cost (quadratic in the list length)."""

RAY_TOKEN_ENV_PREFIX = "WEIGHTSYNC_RAY_TOKEN_"


def ray_token_env_name(deployment_index: int) -> str:
    """Env var of the runtime pod holding a deployment's Ray auth token (from its secretKeyRef).

    `deployment_index` is the position in `WeightSyncSpec.deployments()`: 0 is the source,
    1..n are destinations[0..n-1]. The variable exists only when that deployment names an
    `authSecretRef`; its value must never be logged or reported.
    """
    if deployment_index < 0:
        raise ValueError(f"deployment_index={deployment_index}: must be >= 0")
    return f"{RAY_TOKEN_ENV_PREFIX}{deployment_index}"


class CrdModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class SecretKeyRef(CrdModel):
    name: str
    key: str = "token"


class Parallelism(CrdModel):
    """Expected parallelism of a deployment; discovery checks the real actors against it.

    Not core.topology.ParallelSpec on purpose: this is the CRD's shape (camelCase, bounds the API
    server enforces, `replicas`); `to_spec`/`from_spec` are the one conversion."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    vpp: int = Field(1, ge=1)
    replicas: int = Field(1, ge=1)
    layer_counts: list[int] | None = None

    @classmethod
    def from_spec(cls, spec: ParallelSpec) -> Parallelism:
        """The declared parallelism of a ParallelSpec (inverse of to_spec)."""
        return cls(
            tp=spec.tp,
            pp=spec.pp,
            dp=spec.dp,
            cp=spec.cp,
            ep=spec.ep,
            etp=spec.etp,
            vpp=spec.vpp,
            replicas=spec.replicas,
            layer_counts=list(spec.layer_counts) if spec.layer_counts else None,
        )

    def to_spec(self) -> ParallelSpec:
        return ParallelSpec(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            ep=self.ep,
            etp=self.etp,
            vpp=self.vpp,
            replicas=self.replicas,
            layer_counts=tuple(self.layer_counts) if self.layer_counts else None,
        )


PauseMode = Literal["keep", "wait", "abort"]
"""How a vLLM server's requests in flight are treated while its apply runs (vLLM's `/pause?mode=`):
keep = frozen and continued on the new weights, wait = finished on the old weights first,
abort = ended with finish_reason "abort"."""


class LabelSelector(CrdModel):
    """Pods by labels (equality only: `matchLabels`), in the WeightSync's namespace."""

    match_labels: dict[str, str] = Field(min_length=1)


class VllmServers(CrdModel):
    """A destination made of `vllm serve` pods (one replica per Ready pod, ordered by pod name),
    each started with `--weight-transfer-config '{"backend": "weightsync"}'` and
    `VLLM_SERVER_DEV_MODE=1`; the runtime drives them through vLLM's RL routes on `port`."""

    selector: LabelSelector
    port: int = Field(8000, ge=1, le=65535)
    data_parallel_size: int = Field(1, ge=1, le=1024)
    """Each server's `--data-parallel-size`: pod k holds replicas k*D .. k*D+D-1 (wide EP, dp=D: k)."""


StagingPolicy = Literal["host", "device", "inplace"]
"""Where a destination holds a sync's bytes until the commit decision (docs/update-protocol.md):
host memory (default), a device shadow copy (2x device memory), or live memory (engine paused)."""


class DeploymentRef(CrdModel):
    """Where a model deployment's participant actors live and how they are sharded."""

    name: str
    ray_address: str | None = None
    """Ray cluster address (host:port of the GCS, or ray://host:10001)."""
    ray_cluster: str | None = None
    """A KubeRay RayCluster in the same namespace; the runtime joins its head's GCS as a driver."""
    ray_namespace: str = "weightsync"
    actor_prefix: str | None = None
    """Participants are the named Ray actors whose names start with this prefix (a source, and a
    destination without vllmServers)."""
    layout: Literal["megatron", "megatron-te", "vllm", "hf"]
    parallelism: Parallelism = Parallelism()
    auth_secret_ref: SecretKeyRef | None = None
    """Secret holding the Ray auth token; reaches the runtime only as a secretKeyRef env var."""
    staging: StagingPolicy | None = None
    """Destinations only: overrides transport.staging for this deployment's ranks."""
    vllm_servers: VllmServers | None = None
    """Destinations only, instead of rayAddress/rayCluster/actorPrefix: `vllm serve` pods by label."""
    pause: PauseMode | None = None
    """vllmServers destinations only: the pause mode around each server's apply (unset: keep)."""

    @property
    def pause_mode(self) -> PauseMode:
        return self.pause or "keep"


RAYCLUSTER_GROUP, RAYCLUSTER_VERSION, RAYCLUSTER_PLURAL = "ray.io", "v1", "rayclusters"
DEFAULT_GCS_PORT = 6379
"""KubeRay's default `ray start --head --port` (the GCS), when rayStartParams sets none."""

RayClusterReader = Callable[[str, str], Mapping[str, Any] | None]
"""(namespace, name) -> the RayCluster object, or None when there is none (kube I/O, not here)."""


def resolve_ray_address(
    ref: DeploymentRef, namespace: str, read_cluster: RayClusterReader | None = None
) -> str:
    """The address the runtime connects to for `ref`.

    A `rayCluster` name is read from the Kubernetes API (`read_cluster`) and resolved to its
    head's GCS address (`raycluster_gcs_address`): the runtime joins as a plain Ray driver, so it
    needs no Ray Client (`ray://`, grpc) and speaks the protocol the participants speak.
    """
    if ref.ray_address:
        return ref.ray_address
    if ref.ray_cluster:
        if read_cluster is None:
            raise RayUnreachableError(
                f"deployment {ref.name!r}: rayCluster {ref.ray_cluster!r} needs the Kubernetes API to resolve"
            )
        return raycluster_gcs_address(read_cluster(namespace, ref.ray_cluster), ref.ray_cluster, namespace)
    raise ValueError(f"deployment {ref.name!r}: exactly one of rayAddress or rayCluster must be set")


def raycluster_gcs_address(cluster: Mapping[str, Any] | None, name: str, namespace: str) -> str:
    """`host:port` of a KubeRay RayCluster's GCS, from the object alone (None: it does not exist).

    Host: `status.head.podIP`, else `status.head.serviceIP`. The pod IP comes first because it is
    the address Ray itself advertises for the head node (a driver reaches the head's raylet and
    object store there anyway), and KubeRay's head Service may be headless (no service IP).
    Port: `spec.headGroupSpec.rayStartParams.port` (a string in KubeRay's schema), default 6379.
    """
    where = f"RayCluster {namespace}/{name}"
    if cluster is None:
        raise RayClusterNotFoundError(
            f"{where} not found (rayCluster: {name}; is it created, KubeRay installed?)"
        )
    head = _mapping(_mapping(cluster.get("status")).get("head"))
    host = str(head.get("podIP") or head.get("serviceIP") or "").strip()
    if not host:
        raise RayClusterNotReadyError(f"{where} has no head address yet (status.head.podIP/serviceIP empty)")
    params = _mapping(_mapping(_mapping(cluster.get("spec")).get("headGroupSpec")).get("rayStartParams"))
    raw = str(params.get("port", DEFAULT_GCS_PORT)).strip()
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise RayClusterNotReadyError(f"{where}: rayStartParams.port {raw!r} is not a TCP port")
    return f"{host}:{int(raw)}"


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class Transport(CrdModel):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    bucket_mb: int = Field(64, ge=1, le=4096)
    staging_budget_mb: int = Field(512, ge=2, le=65536)
    max_fan_in: int = Field(4, ge=1, le=64)
    relay: Literal["off", "auto", "on"] = "off"
    connect_timeout_seconds: int = Field(120, ge=1)
    transfer_timeout_seconds: int = Field(300, ge=1)
    staging: StagingPolicy = "host"
    """The destinations' staging policy, unless a destination sets its own (DeploymentRef.staging)."""
    snapshot: bool = False
    """Copy the source shards to host memory first, so the trainer may step during the transfer."""
    delta: Literal["auto", "off"] = "auto"
    """auto: a replica whose ranks all hold the version a source last sent gets only the changed
    elements (docs/update-protocol.md); off: every sync in full."""


class RetryPolicy(CrdModel):
    limit: int = Field(3, ge=0)
    """How many times a dead runtime pod is replaced before the WeightSync is Failed."""
    backoff_seconds: int = Field(10, ge=0)
    max_backoff_seconds: int = Field(300, ge=0)


class RuntimeOverrides(CrdModel):
    """What a WeightSync author may set on its runtime pod; the operator checks image and env
    against its installer's allowlist. The ServiceAccount is never the author's to choose."""

    image: str | None = None
    resources: dict | None = None
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
    allow_unauthenticated_ray: bool = False
    """Accept deployments without authSecretRef (the operator posts a Warning Event)."""

    def staging_of(self, deployment: str) -> StagingPolicy:
        """The staging policy of a destination deployment (by name)."""
        ref = next(d for d in self.destinations if d.name == deployment)
        return ref.staging or self.transport.staging

    def deployments(self) -> list[DeploymentRef]:
        """Source first, then destinations: the index order of `ray_token_env_name`."""
        return [self.source, *self.destinations]


# ---- spec rules the schema's CEL also enforces (same messages) ----------------------------------

MSG_ONE_ADDRESS = "exactly one of rayAddress or rayCluster must be set"
MSG_SOURCE_PREFIX = "source: actorPrefix must be set"
MSG_SOURCE_SERVERS = "source: vllmServers and pause apply to destinations only"
MSG_DEST_TARGET = "destination: exactly one of actorPrefix or vllmServers must be set"
MSG_SERVERS_NO_RAY = (
    "vllmServers: rayAddress and rayCluster must not be set (the runtime attaches the servers in "
    "the source's Ray cluster)"
)
MSG_SERVERS_LAYOUT = "vllmServers: layout must be vllm"
MSG_SERVERS_DP = "vllmServers: parallelism.replicas must be a multiple of dataParallelSize"
MSG_SERVERS_WIDE_EP = "vllmServers: with parallelism.dp > 1 (wide EP) dataParallelSize must equal dp"
MSG_PAUSE_SERVERS = "pause applies to vllmServers destinations only"
MSG_UNIQUE_DESTINATIONS = "destination names must be unique"
MSG_SOURCE_NAME_CLASH = "destination names must differ from the source name"
MEGATRON_LAYOUTS = ("megatron", "megatron-te")
MSG_SOURCE_LAYOUT = "source layout must be megatron or hf (vllm is destination-only)"
MSG_DEST_LAYOUT = "destination layout must be vllm or hf (megatron is source-only)"
MSG_SOURCE_EP = "source: ep must divide tp*cp*dp"
MSG_SOURCE_ETP = "source: ep*etp must divide tp*cp*dp"
MSG_SOURCE_REPLICAS = "source: replicas must be 1 (use dp for data-parallel copies)"
MSG_SOURCE_STAGING = "source: staging applies to destinations only"
MSG_DEST_EP = "destination: ep must be 1, tp (EP inside TP) or tp*dp (wide EP)"
MSG_DEST_DP = "destination: dp > 1 is vLLM's wide EP only (ep = tp*dp, pp = 1)"
MSG_DEST_CP = "destination: cp must be 1 (context parallelism is a trainer-side axis)"
MSG_DEST_ETP_VPP = "destination: etp and vpp must be 1"
MSG_HF_SHAPE = "hf layout: pp, ep and vpp must be 1"
MSG_VPP_MEGATRON = "vpp > 1 needs a megatron layout"
MSG_LAYER_COUNTS = "layerCounts must have one entry per pipeline stage (pp)"
MSG_BUCKET = "bucketMb must be at most stagingBudgetMb/2 (double buffering)"
MSG_BACKOFF = "maxBackoffSeconds must be >= backoffSeconds"
MSG_VERSION = f"version must match {VERSION_PATTERN}"
MSG_RAY_AUTH = (
    "every deployment needs authSecretRef (Ray token authentication) unless allowUnauthenticatedRay is true"
)


def _deployment_problems(ref: DeploymentRef, where: str) -> list[str]:
    p = ref.parallelism
    out = []
    if ref.vllm_servers is None and (ref.ray_address is None) == (ref.ray_cluster is None):
        out.append(f"{where}: {MSG_ONE_ADDRESS}")
    if p.layer_counts is not None and len(p.layer_counts) != p.pp:
        out.append(f"{where}.parallelism: {MSG_LAYER_COUNTS}")
    if ref.layout == "hf" and (p.pp, p.ep, p.vpp) != (1, 1, 1):
        out.append(f"{where}: {MSG_HF_SHAPE}")
    if p.vpp > 1 and ref.layout not in MEGATRON_LAYOUTS:
        out.append(f"{where}: {MSG_VPP_MEGATRON}")
    return out


def _server_problems(dest: DeploymentRef, where: str) -> list[str]:
    """A destination names its engines either by actor prefix or as vLLM server pods."""
    out = []
    if (dest.actor_prefix is None) == (dest.vllm_servers is None):
        out.append(f"{where}: {MSG_DEST_TARGET}")
    if dest.vllm_servers is not None:
        if dest.ray_address is not None or dest.ray_cluster is not None:
            out.append(f"{where}: {MSG_SERVERS_NO_RAY}")
        if dest.layout != "vllm":
            out.append(f"{where}: {MSG_SERVERS_LAYOUT}")
        p, dp = dest.parallelism, dest.vllm_servers.data_parallel_size
        if p.replicas % dp if p.dp == 1 else dp != p.dp:  # wide EP (dp > 1): one replica per pod
            out.append(f"{where}: {MSG_SERVERS_DP if p.dp == 1 else MSG_SERVERS_WIDE_EP}")
    elif dest.pause is not None:
        out.append(f"{where}: {MSG_PAUSE_SERVERS}")
    return out


def ray_deployments(spec: WeightSyncSpec) -> list[DeploymentRef]:
    """The deployments that name a Ray cluster (vllmServers are attached in the source's one)."""
    return [d for d in spec.deployments() if d.vllm_servers is None]


def spec_problems(spec: WeightSyncSpec) -> list[str]:
    """What the CRD's CEL rules refuse, each prefixed by the field path; [] for a valid spec.

    The operator also calls this, so a CR that got past an older CRD still ends Degraded with
    reason InvalidSpec rather than reaching the runtime.
    """
    out = _deployment_problems(spec.source, "spec.source")
    src = spec.source.parallelism
    if spec.source.layout == "vllm":
        out.append(f"spec.source: {MSG_SOURCE_LAYOUT}")
    if (src.tp * src.cp * src.dp) % src.ep:
        out.append(f"spec.source: {MSG_SOURCE_EP}")
    if (src.tp * src.cp * src.dp) % (src.ep * src.etp):
        out.append(f"spec.source: {MSG_SOURCE_ETP}")
    if src.replicas != 1:
        out.append(f"spec.source: {MSG_SOURCE_REPLICAS}")
    if spec.source.staging is not None:
        out.append(f"spec.source: {MSG_SOURCE_STAGING}")
    if spec.source.actor_prefix is None:
        out.append(f"spec.source: {MSG_SOURCE_PREFIX}")
    if spec.source.vllm_servers is not None or spec.source.pause is not None:
        out.append(f"spec.source: {MSG_SOURCE_SERVERS}")
    names = [d.name for d in spec.destinations]
    if len(set(names)) != len(names):
        out.append(f"spec.destinations: {MSG_UNIQUE_DESTINATIONS}")
    if spec.source.name in names:
        out.append(f"spec: {MSG_SOURCE_NAME_CLASH}")
    for i, dest in enumerate(spec.destinations):
        where, p = f"spec.destinations[{i}]", dest.parallelism
        out += _deployment_problems(dest, where)
        if dest.layout in MEGATRON_LAYOUTS:
            out.append(f"{where}: {MSG_DEST_LAYOUT}")
        if p.ep not in (1, p.tp, p.tp * p.dp):
            out.append(f"{where}: {MSG_DEST_EP}")
        if p.dp != 1 and (p.ep != p.tp * p.dp or p.pp != 1):
            out.append(f"{where}: {MSG_DEST_DP}")
        if p.cp != 1:
            out.append(f"{where}: {MSG_DEST_CP}")
        if (p.etp, p.vpp) != (1, 1):
            out.append(f"{where}: {MSG_DEST_ETP_VPP}")
        out += _server_problems(dest, where)
    if spec.transport.bucket_mb * 2 > spec.transport.staging_budget_mb:
        out.append(f"spec.transport: {MSG_BUCKET}")
    if spec.retry.max_backoff_seconds < spec.retry.backoff_seconds:
        out.append(f"spec.retry: {MSG_BACKOFF}")
    if not re.fullmatch(VERSION_PATTERN, spec.version):
        out.append(f"spec.version: {MSG_VERSION}")
    if not spec.allow_unauthenticated_ray and any(
        d.auth_secret_ref is None and d.vllm_servers is None for d in spec.deployments()
    ):
        out.append(f"spec: {MSG_RAY_AUTH}")
    return out
