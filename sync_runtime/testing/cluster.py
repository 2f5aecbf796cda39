"""Ray-side helpers of the demo, shared with tests and end-to-end checks: an embedded cluster,
seeded participants named by convention, the WeightSync that connects them, "train a step",
and the bit-exact check of every destination rank.

Actor names: `{src_prefix}src-pp{p}-dp{d}-tp{t}` and `{dst_prefix}r{k}-pp{p}-tp{t}`; discovery
only uses the prefixes, identity comes from the coordinates each actor reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.runtime.discovery import Participant, find_actors, gather
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.crd import DeploymentRef, Parallelism, Transport, WeightSyncSpec
from sync_runtime.testing.weights import DemoDestination, DemoSource, expected_sha256, model_config

DEFAULT_MODEL = "tiny-qwen3-moe"
DEFAULT_NAMESPACE = "weightsync-demo"
READY_TIMEOUT_S = 180.0
"""Actor start-up on a loaded 2-core machine: each worker imports torch."""


@dataclass(kw_only=True)
class DemoSetup:
    """Everything that defines a demo deployment pair: model, topologies, seed, where the actors live."""

    model: str
    config: dict[str, Any]
    manifest: Manifest
    src: ParallelSpec
    dst: ParallelSpec
    seed: int = 0
    namespace: str = DEFAULT_NAMESPACE
    src_prefix: str = "trainer-"
    dst_prefix: str = "infer-"
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        model: str = DEFAULT_MODEL,
        src: str | ParallelSpec = "tp=2,pp=2,ep=2",
        dst: str | ParallelSpec = "tp=2,ep=2,replicas=2",
        **kw: Any,
    ) -> DemoSetup:
        config = model_config(model)
        return cls(
            model=model,
            config=config,
            manifest=build_manifest(config),
            src=src if isinstance(src, ParallelSpec) else ParallelSpec.parse(src),
            dst=dst if isinstance(dst, ParallelSpec) else ParallelSpec.parse(dst),
            **kw,
        )


def source_name(prefix: str, c: RankCoord) -> str:
    cp = f"-cp{c.cp_rank}" if c.cp_rank else ""  # CP ranks hold the same shards: names must differ
    return f"{prefix}src-pp{c.pp_rank}-dp{c.dp_rank}{cp}-tp{c.tp_rank}"


def destination_name(prefix: str, c: RankCoord) -> str:
    return f"{prefix}r{c.replica}-pp{c.pp_rank}-tp{c.tp_rank}"


RAYLET_TIMEOUT = "The current node timed out during startup"
"""Ray's message when its raylet did not register with the GCS in its fixed wait."""


def start_local_ray(num_cpus: int = 2, namespace: str = DEFAULT_NAMESPACE) -> str:
    """An embedded Ray cluster sized for CI (no dashboard, small object store); returns its address.

    Started again when Ray gave up waiting for its own raylet: Ray allows a fixed 30 s for the
    raylet to register with the GCS (ray/_private/node.py), which a loaded 2-core machine can
    exceed."""
    for attempt in range(1, 4):
        if ray.is_initialized():
            break
        try:
            ray.init(
                address="local",  # always a fresh cluster: never join one another process started here
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=128 << 20,
                namespace=namespace,
                logging_level="WARNING",
                log_to_driver=False,
            )
        except Exception as e:  # Ray raises a bare Exception for this
            if attempt == 3 or RAYLET_TIMEOUT not in str(e):
                raise
            ray.shutdown()
    return ray.get_runtime_context().gcs_address


def connect(address: str, namespace: str) -> None:
    """Join an existing cluster as a driver (token auth: RAY_AUTH_MODE/RAY_AUTH_TOKEN in the env)."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level="WARNING", log_to_driver=False)


ClassFor = Callable[[RankCoord], type]


def _placed_coords(setup: DemoSetup, role: Role) -> list[RankCoord]:
    """Coordinates without placement: each actor reports its real node IP and device itself."""
    spec = setup.src if role is Role.SOURCE else setup.dst
    return [
        dataclasses.replace(c, node=RankCoord(role=role).node, device=RankCoord(role=role).device)
        for c in enumerate_ranks(spec, role)
    ]


def create_participants(
    setup: DemoSetup,
    *,
    src_version: str,
    dst_version: str,
    detached: bool = False,
    source_class: ClassFor | None = None,
    dest_class: ClassFor | None = None,
    skip: Callable[[RankCoord], bool] | None = None,
    max_concurrency: int | None = None,
) -> list[Any]:
    """Start one named actor per rank and wait until all are ready.

    Sources hold the weights of `src_version`, destinations those of `dst_version`.
    `source_class`/`dest_class` pick a class per rank (tests use faulty subclasses); `skip`
    leaves ranks out (tests of a missing rank). `max_concurrency` > 1 makes threaded actors,
    whose status calls (and a training step) run while a sync runs on them.
    """
    jobs = [
        (c, source_name(setup.src_prefix, c), (source_class or _default_source)(c), setup.src, src_version)
        for c in _placed_coords(setup, Role.SOURCE)
    ]
    jobs += [
        (c, destination_name(setup.dst_prefix, c), (dest_class or _default_dest)(c), setup.dst, dst_version)
        for c in _placed_coords(setup, Role.DESTINATION)
    ]
    handles = []
    for coord, name, cls, spec, version in jobs:
        if skip is not None and skip(coord):
            continue
        options: dict[str, Any] = {"name": name, "namespace": setup.namespace, "num_cpus": 0}
        if max_concurrency is not None:
            options["max_concurrency"] = max_concurrency
        if detached:
            options["lifetime"] = "detached"  # outlives this driver (end-to-end clusters)
        handles.append(
            ray.remote(cls).options(**options).remote(setup.config, spec, coord, setup.seed, version)
        )
    ready, pending = ray.wait(
        [h.ws_version.remote() for h in handles], num_returns=len(handles), timeout=READY_TIMEOUT_S
    )
    if pending:
        raise TimeoutError(f"{len(pending)} participant(s) not ready within {READY_TIMEOUT_S:g}s")
    ray.get(ready)  # surfaces constructor errors
    setup.handles.extend(handles)
    return handles


def _default_source(_: RankCoord) -> type:
    return DemoSource


def _default_dest(_: RankCoord) -> type:
    return DemoDestination


def weightsync_spec(
    setup: DemoSetup,
    version: str,
    *,
    address: str,
    transport: Transport | None = None,
    src: ParallelSpec | None = None,
    dst: ParallelSpec | None = None,
) -> WeightSyncSpec:
    """The WeightSync the demo (or a test) runs; `src`/`dst` override the declared parallelism."""

    def ref(name: str, prefix: str, layout: str, spec: ParallelSpec) -> DeploymentRef:
        return DeploymentRef(
            name=name,
            ray_address=address,
            ray_namespace=setup.namespace,
            actor_prefix=prefix,
            layout=layout,
            parallelism=Parallelism.from_spec(spec),
        )

    return WeightSyncSpec(
        source=ref("trainer", setup.src_prefix, "megatron", src or setup.src),
        destinations=[ref("inference", setup.dst_prefix, "vllm", dst or setup.dst)],
        version=version,
        model=setup.model,
        transport=transport or Transport(),
    )


def train_step(setup: DemoSetup, version: str) -> None:
    """Every source regenerates the seeded weights of `version` in place."""
    actors = find_actors(setup.namespace, setup.src_prefix)
    ray.get([h.ws_set_version_weights.remote(setup.seed, version) for _, h in actors])


def destination_participants(setup: DemoSetup, timeout_s: float = 60.0) -> list[Participant]:
    ref = DeploymentRef(
        name="inference",
        ray_address="-",
        ray_namespace=setup.namespace,
        actor_prefix=setup.dst_prefix,
        layout="vllm",
    )
    found = gather(ref, timeout_s)
    return sorted(found, key=lambda p: p.meta.coord.key)


def verify_destinations(
    setup: DemoSetup, version: str, want_for: Callable[[RankCoord], dict[str, str]] | None = None
) -> list[str]:
    """Problems found (empty = every destination rank holds exactly version `version`, bit for bit).
    `want_for(coord)`: the sha256 of every tensor that rank must hold; by default the demo's seeded
    weights of `version` (a caller with its own reference, e.g. a trainer's, passes its own)."""
    problems = []
    participants = destination_participants(setup)
    sums = ray.get([p.handle.ws_sha256.remote() for p in participants])
    for p, got in zip(participants, sums, strict=True):
        if p.meta.version != version:
            problems.append(f"{p.name}: version {p.meta.version!r}, expected {version!r}")
        if want_for is None:
            want = expected_sha256(setup.manifest, "vllm", setup.dst, p.meta.coord, setup.seed, version)
        else:
            want = want_for(p.meta.coord)
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        if bad:
            problems.append(f"{p.name}: {len(bad)} tensor(s) differ from the reference, e.g. {bad[0]}")
    expected_ranks = setup.dst.world_size
    if len(participants) != expected_ranks:
        problems.append(f"found {len(participants)} destination ranks, expected {expected_ranks}")
    return problems


def kill_participants(setup: DemoSetup) -> None:
    for h in setup.handles:
        ray.kill(h, no_restart=True)
    setup.handles.clear()
