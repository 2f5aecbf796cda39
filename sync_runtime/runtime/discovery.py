"""Discovery: find a deployment's participants by Ray namespace and actor-name prefix, and the
actors registered for the deployment (runtime/registry.py); gather what each reports, and check
it against the declared parallelism and the manifest.

Names only select candidates; identity comes from the coordinates each participant reports.
Every mismatch is found before a byte moves and reported together, each line naming the rank
and what differs (missing/duplicate rank, wrong TP/PP/DP/replica size, tensor shape or dtype).

Dtypes: the manifest's dtype of a canonical tensor is its wire dtype, the source's own: a source
rank holding a tensor in another dtype is refused (it sends its bytes unchanged). A destination
rank may hold a tensor in another dtype when a cast is defined (float32/bfloat16/float16 among
themselves, `core.manifest.cast_defined`); it then gets `Participant.wire_dtypes`, handed to the
rank with its program (`TransferConfig.wire_dtypes`), and casts on receipt. Any other difference
(an integer or fp8 tensor on one side) is refused, naming tensor and rank (docs/dtypes.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.manifest import Manifest, cast_defined
from sync_runtime.core.models import load_model_config
from sync_runtime.core.models.config import model_dims
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import DiscoveryError, TopologyMismatchError, describe_unexpected
from sync_runtime.planner import SideSpec
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.mtp_side import ReportedRank, side_holds_mtp
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.runtime.registry import Registration, actor_id, forget_dead, registered
from sync_runtime.runtime.servers import with_server_actors
from sync_runtime.schema.crd import DeploymentRef, WeightSyncSpec

MAX_LISTED = 12
"""Mismatch lines shown in one error; the rest are counted."""


@dataclass(frozen=True, slots=True)
class Participant:
    handle: Any
    """Ray actor handle."""
    name: str
    namespace: str
    meta: ParticipantMeta
    wire_dtypes: tuple[tuple[str, str], ...] = ()
    """Destination: (canonical tensor, wire dtype) for each tensor it holds in another dtype (the
    rank casts on receipt); set by `check_side`."""


@dataclass(frozen=True, slots=True)
class DiscoveredSide:
    """One deployment as found: participants in global-rank order (`enumerate_ranks` order)."""

    ref: DeploymentRef
    role: Role
    spec: ParallelSpec
    participants: tuple[Participant, ...]
    mtp: bool = False
    """Its ranks hold the manifest's MTP part (what they report: runtime/mtp_side.py)."""

    def side_spec(self) -> SideSpec:
        coords = tuple(p.meta.coord for p in self.participants)
        return SideSpec(layout=self.ref.layout, spec=self.spec, coords=coords, mtp=self.mtp)


def rank_label(coord: RankCoord) -> str:
    if coord.role is Role.SOURCE:
        cp = f",cp={coord.cp_rank}" if coord.cp_rank else ""
        return f"pp={coord.pp_rank},dp={coord.dp_rank}{cp},tp={coord.tp_rank}"
    dp = f",dp={coord.dp_rank}" if coord.dp_rank else ""  # wide EP's DP engines of one replica
    return f"replica={coord.replica},pp={coord.pp_rank}{dp},tp={coord.tp_rank}"


def find_actors(namespace: str, prefix: str) -> list[tuple[str, Any]]:
    """(name, handle) of the named actors in `namespace` whose name starts with `prefix`, sorted."""
    found = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == namespace and a["name"].startswith(prefix)
    )
    return [(name, ray.get_actor(name, namespace=namespace)) for name in found]


def candidates(ref: DeploymentRef) -> tuple[list[tuple[str, Any]], dict[str, Registration]]:
    """The named actors with `ref`'s prefix, then the actors registered for `ref.name` that are
    not among them (runtime/registry.py); the second item maps registered names to registrations."""
    prefix = ref.actor_prefix
    actors = find_actors(ref.ray_namespace, prefix) if prefix is not None else []
    seen = {actor_id(h) for _, h in actors}
    extra = {r.name: r for r in registered(ref.ray_namespace, ref.name) if r.actor_id not in seen}
    if not actors and not extra:
        raise DiscoveryError(
            f"deployment {ref.name!r}: no named actors starting with {ref.actor_prefix!r} "
            f"in Ray namespace {ref.ray_namespace!r}, and no actors registered for {ref.name!r} there"
        )
    return actors + [(r.name, r.handle) for r in extra.values()], extra


def gather(ref: DeploymentRef, timeout_s: float) -> list[Participant]:
    """Ask every candidate actor of `ref` for its meta, concurrently, within `timeout_s`."""
    actors, extra = candidates(ref)
    refs = {h.ws_meta.remote(): (name, h) for name, h in actors}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = ", ".join(refs[r][0] for r in pending)
        raise DiscoveryError(f"deployment {ref.name!r}: no metadata within {timeout_s:g}s from {late}")
    out, dead = [], []
    for r in ready:
        name, handle = refs[r]
        try:
            meta = ray.get(r)
        except ray.exceptions.RayActorError as e:
            if name not in extra:
                raise DiscoveryError(
                    f"deployment {ref.name!r}: actor {name} failed ws_meta: {describe_unexpected(e)}"
                ) from e
            dead.append(extra[name])  # a registration that outlived its actor: its rank is missing
            continue
        except ray.exceptions.RayError as e:
            raise DiscoveryError(
                f"deployment {ref.name!r}: actor {name} failed ws_meta: {describe_unexpected(e)}"
            ) from e
        if isinstance(meta, list | tuple):  # one actor, several ranks (an engine with TP workers)
            out += [
                Participant(
                    handle=RankHandle(handle, i), name=f"{name}#{i}", namespace=ref.ray_namespace, meta=m
                )
                for i, m in enumerate(meta)
            ]
            continue
        out.append(Participant(handle=handle, name=name, namespace=ref.ray_namespace, meta=meta))
    forget_dead(ref.ray_namespace, ref.name, dead)
    return out


class RankHandle:
    """One rank of a multi-rank actor, called like an actor handle.

    An actor whose `ws_meta()` returns a list (e.g. engines/vllm_replica.py: one vLLM engine,
    one rank per worker) is N participants; `getattr(h, method).remote(*args)` becomes
    `actor.ws_rank_call.remote(index, method, args)` and returns that call's ObjectRef, so the
    coordinator drives every rank alike.
    """

    def __init__(self, actor: Any, index: int) -> None:
        self.actor = actor
        self.index = index

    def __getattr__(self, method: str) -> _RankMethod:
        if method.startswith("_"):  # dunders and private names are never remote methods
            raise AttributeError(method)
        return _RankMethod(self.actor, self.index, method)

    def __repr__(self) -> str:
        return f"RankHandle({self.actor!r}, {self.index})"


@dataclass(frozen=True, slots=True)
class _RankMethod:
    actor: Any
    index: int
    method: str

    def remote(self, *args: Any) -> Any:
        return self.actor.ws_rank_call.remote(self.index, self.method, args)


def check_side(
    ref: DeploymentRef,
    role: Role,
    participants: Sequence[Participant],
    manifest: Manifest,
) -> DiscoveredSide:
    """Match participants to the declared topology; raise TopologyMismatchError listing every difference."""
    spec = ref.parallelism.to_spec()
    get_layout(ref.layout).validate(manifest, spec)
    problems = _identity_problems(ref, role, participants)
    expected = {c.key: c for c in enumerate_ranks(spec, role)}
    reported = [
        ReportedRank(
            f"rank {rank_label(p.meta.coord)}", p.meta.coord, frozenset(t.name for t in p.meta.tensors)
        )
        for p in participants
        if p.meta.layout == ref.layout and p.meta.role is role and p.meta.coord.key in expected
    ]
    mtp = side_holds_mtp(ref.name, ref.layout, spec, manifest, reported)
    manifest = manifest.with_mtp() if mtp else manifest  # the tensors its ranks are checked against
    by_key = {p.meta.coord.key: p for p in participants}
    problems += _size_problems(spec, role, [p.meta.coord for p in participants])
    for key, want in expected.items():
        if key not in by_key:
            problems.append(f"missing rank {rank_label(want)}")
    for key, p in by_key.items():
        if key not in expected:
            problems.append(f"unexpected rank {rank_label(p.meta.coord)} (actor {p.name})")
    casts: dict[tuple, tuple[tuple[str, str], ...]] = {}
    wire = {t.name: t.dtype for t in manifest.tensors}
    # Megatron makes expert_tensor_parallel_size = TP unless told otherwise, for a dense model
    # too: there its expert coordinates place nothing, so they are neither compared nor kept.
    dense = model_dims(manifest.config).num_experts == 0  # validate() above parsed this config
    if dense:
        by_key = {k: _declared_expert_coords(p, expected[k]) for k, p in by_key.items() if k in expected}
    for key, want in expected.items():
        # Shapes are only meaningful for a rank that sits where it should, under the right layout.
        if key in by_key and by_key[key].meta.layout == ref.layout:
            rank_problems, casts[key] = _rank_problems(ref, spec, manifest, wire, by_key[key], want)
            problems += rank_problems
    if problems:
        raise TopologyMismatchError(_format(ref, spec, problems))
    ordered = tuple(dataclasses.replace(by_key[key], wire_dtypes=casts.get(key, ())) for key in expected)
    return DiscoveredSide(ref=ref, role=role, spec=spec, participants=ordered, mtp=mtp)


def _declared_expert_coords(p: Participant, want: RankCoord) -> Participant:
    coord = dataclasses.replace(
        p.meta.coord, ep_rank=want.ep_rank, etp_rank=want.etp_rank, edp_rank=want.edp_rank
    )
    return dataclasses.replace(p, meta=dataclasses.replace(p.meta, coord=coord))


def _identity_problems(ref: DeploymentRef, role: Role, participants: Sequence[Participant]) -> list[str]:
    problems = []
    for p in participants:
        if p.meta.role is not role:
            problems.append(f"actor {p.name} reports role {p.meta.role.value}, expected {role.value}")
        if p.meta.layout != ref.layout:
            problems.append(f"actor {p.name} reports layout {p.meta.layout!r}, expected {ref.layout!r}")
    counts = Counter(p.meta.coord.key for p in participants)
    for key, n in counts.items():
        if n > 1:
            names = sorted(p.name for p in participants if p.meta.coord.key == key)
            coord = next(p.meta.coord for p in participants if p.meta.coord.key == key)
            problems.append(f"duplicate rank {rank_label(coord)} reported by {', '.join(names)}")
    return problems


def _size_problems(spec: ParallelSpec, role: Role, coords: Sequence[RankCoord]) -> list[str]:
    """Sizes the actors imply (highest rank + 1) against the declared ones: 'wrong TP size'."""
    axes = [("TP", "tp_rank", spec.tp), ("PP", "pp_rank", spec.pp)]
    axes.append(("DP", "dp_rank", spec.dp))  # a destination's: wide EP's DP engines of one replica
    if role is Role.DESTINATION:
        axes.append(("replicas", "replica", spec.replicas))
    if role is Role.SOURCE:
        axes.append(("CP", "cp_rank", spec.cp))
    problems = []
    for label, attr, declared in axes:
        seen = sorted({getattr(c, attr) for c in coords})
        if seen and (seen[-1] + 1 != declared or seen[0] < 0):
            problems.append(
                f"{label} size: actors report {attr} {seen} ({label}={seen[-1] + 1}), "
                f"expected {label}={declared}"
            )
    return problems


def _rank_problems(
    ref: DeploymentRef,
    spec: ParallelSpec,
    manifest: Manifest,
    wire: Mapping[str, str],
    p: Participant,
    want: RankCoord,
) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """What differs at one rank, and the casts a destination rank needs (canonical, wire dtype)."""
    got, label = p.meta.coord, f"rank {rank_label(p.meta.coord)} (actor {p.name})"
    problems = [
        f"{label}: {attr}={getattr(got, attr)}, expected {getattr(want, attr)}"
        for attr in ("ep_rank", "etp_rank", "edp_rank")
        if getattr(got, attr) != getattr(want, attr)
    ]
    shard = get_layout(ref.layout).shard(manifest, spec, got)
    expected = {t.name: t for t in shard.tensors}
    reported = {t.name: t for t in p.meta.tensors}
    for name in expected.keys() - reported.keys():
        problems.append(f"{label}: missing tensor {name} {list(expected[name].shape)}")
    for name in reported.keys() - expected.keys():
        problems.append(f"{label}: unexpected tensor {name} {list(reported[name].shape)}")
    for name in sorted(expected.keys() & reported.keys()):
        e, r = expected[name], reported[name]
        if tuple(e.shape) != tuple(r.shape):
            problems.append(
                f"{label}: tensor {name} has shape {list(r.shape)}, manifest says {list(e.shape)}"
            )
    casts: dict[str, str] = {}
    for piece in shard.pieces:  # per canonical tensor: a fused local tensor may hold several
        r = reported.get(piece.local_name)
        if r is None or wire[piece.tensor] == r.dtype:
            continue
        problem = _dtype_problem(p.meta.role, piece.local_name, r.dtype, wire[piece.tensor])
        if problem is None:
            casts[piece.tensor] = wire[piece.tensor]
        elif f"{label}: {problem}" not in problems:
            problems.append(f"{label}: {problem}")
    return problems, tuple(sorted(casts.items()))


def _dtype_problem(role: Role, name: str, held: str, wire: str) -> str | None:
    """Why a rank holding `name` as `held` cannot take part when the wire carries `wire` (None: it can)."""
    if role is Role.SOURCE:
        return (
            f"tensor {name} has dtype {held}, manifest says {wire} (a source sends its own bytes: the "
            "manifest's dtype must be the source's; set weightsync_tensor_dtypes, or leave spec.model unset)"
        )
    if cast_defined(wire, held):
        return None
    return (
        f"tensor {name} has dtype {held}, manifest says {wire}: no cast is defined between them "
        "(a destination may differ only among float32, bfloat16 and float16)"
    )


def _format(ref: DeploymentRef, spec: ParallelSpec, problems: list[str]) -> str:
    shown = problems[:MAX_LISTED]
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    head = (
        f"deployment {ref.name!r} ({ref.layout}, {spec.describe()}, actors "
        f"{ref.ray_namespace}/{ref.actor_prefix}*) does not match: {len(problems)} difference(s)"
    )
    return head + "".join(f"\n  - {line}" for line in shown) + more


def topology_digest(manifest: Manifest, sides: Sequence[DiscoveredSide]) -> str:
    """Changes whenever a plan or the process group would: tensors, coords, layouts, actor identities."""
    doc = {
        "tensors": [[t.name, list(t.shape), t.dtype] for t in manifest.tensors],
        "sides": [
            {
                "layout": s.ref.layout,
                "spec": dataclasses.asdict(s.spec),
                "ranks": [[dataclasses.asdict(p.meta.coord), p.meta.actor_id] for p in s.participants],
                **({"mtp": True} if s.mtp else {}),  # digests of sides without MTP unchanged
            }
            for s in sides
        ],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _manifest(spec: WeightSyncSpec, sources: Sequence[Participant]) -> Manifest:
    if spec.model:
        return build_manifest(load_model_config(spec.model))
    configs = [p.meta.model_config for p in sources if p.meta.model_config]
    if not configs:
        raise DiscoveryError(
            "spec.model is not set and no source actor reports a model config (ws_init model_config)"
        )
    return build_manifest(configs[0])


def discover_all(
    spec: WeightSyncSpec,
    manifest: Manifest | None,
    timeout_s: float,
) -> tuple[Manifest, list[DiscoveredSide], str]:
    """Source first, then each destination; everything checked before a byte moves.

    Raises the WeightSyncError of what is wrong (DiscoveryError, TopologyMismatchError,
    LayoutError), each with step discover."""
    spec = with_server_actors(spec)  # vllmServers destinations: their proxies, attached now
    found = [gather(spec.source, timeout_s)] + [gather(d, timeout_s) for d in spec.destinations]
    manifest = manifest or _manifest(spec, found[0])
    roles = [Role.SOURCE] + [Role.DESTINATION] * len(spec.destinations)
    refs = [spec.source, *spec.destinations]
    sides = [check_side(ref, role, ps, manifest) for ref, role, ps in zip(refs, roles, found, strict=True)]
    serving = [s.ref.name for s in sides[1:] if s.mtp]
    if serving and not sides[0].mtp:
        raise TopologyMismatchError(
            f"destination {serving[0]!r} serves MTP (its ranks report draft tensors), but source "
            f"{spec.source.name!r} holds no MTP part to send"
        )
    return manifest, sides, topology_digest(manifest, sides)
