"""Discovery and the topology check: every mismatch is refused before a byte moves, with a
message naming what differs. Table tests of `check_side` on reported metas (pure), then the
same refusals end to end through the coordinator against real Ray actors.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.base import LocalTensorMeta
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import RayUnreachableError, Reason, TopologyMismatchError
from sync_runtime.runtime.connect import connect_ray
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.discovery import Participant, check_side
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.schema.crd import DeploymentRef, Parallelism, WeightSyncSpec
from sync_runtime.schema.report import NullReporter, SyncResult, SyncStep
from sync_runtime.testing.cluster import (
    DemoSetup,
    create_participants,
    destination_participants,
    kill_participants,
    source_name,
    weightsync_spec,
)
from sync_runtime.testing.weights import DemoDestination

pytestmark = pytest.mark.e2e

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
MANIFEST = build_manifest(load_model_config("tiny-qwen3-moe"))


def _ref(layout: str, prefix: str = "p-", **par) -> DeploymentRef:
    return DeploymentRef(
        name="d", ray_address="x:1", actor_prefix=prefix, layout=layout, parallelism=Parallelism(**par)
    )


def _participants(layout: str, spec: ParallelSpec, role: Role) -> list[Participant]:
    out = []
    for i, c in enumerate(enumerate_ranks(spec, role)):
        shard = get_layout(layout).shard(MANIFEST, spec, c)
        meta = ParticipantMeta(
            role=role,
            coord=c,
            layout=layout,
            tensors=shard.tensors,
            node_ip="10.0.0.1",
            device="cpu",
            pid=100 + i,
            actor_name=f"p-{i}",
            actor_id=f"id{i}",
            version="v0",
            group_name=None,
            group_healthy=False,
        )
        out.append(Participant(handle=None, name=f"p-{i}", namespace="ns", meta=meta))
    return out


def _with_meta(p: Participant, **changes) -> Participant:
    return dataclasses.replace(p, meta=dataclasses.replace(p.meta, **changes))


SRC = ParallelSpec(tp=2, pp=2, ep=2)
DST = ParallelSpec(tp=2, ep=2, replicas=2)


def test_matching_sides_are_ordered_by_rank():
    ps = _participants("megatron", SRC, Role.SOURCE)
    side = check_side(_ref("megatron", tp=2, pp=2, ep=2), Role.SOURCE, list(reversed(ps)), MANIFEST)
    assert [p.meta.coord.key for p in side.participants] == [c.key for c in enumerate_ranks(SRC, Role.SOURCE)]


def _refused(ref, role, ps) -> str:
    with pytest.raises(TopologyMismatchError) as e:
        check_side(ref, role, ps, MANIFEST)
    return str(e.value)


def test_missing_rank_named():
    ps = _participants("megatron", SRC, Role.SOURCE)
    msg = _refused(_ref("megatron", tp=2, pp=2, ep=2), Role.SOURCE, ps[:-1])
    assert "missing rank pp=1,dp=0,tp=1" in msg


def test_duplicate_rank_named():
    ps = _participants("vllm", DST, Role.DESTINATION)
    dup = dataclasses.replace(ps[0], name="p-dup")
    msg = _refused(_ref("vllm", tp=2, ep=2, replicas=2), Role.DESTINATION, [*ps, dup])
    assert "duplicate rank replica=0,pp=0,tp=0 reported by p-0, p-dup" in msg


def test_wrong_tp_size_named():
    ps = _participants("vllm", DST, Role.DESTINATION)
    msg = _refused(_ref("vllm", tp=4, ep=4, replicas=2), Role.DESTINATION, ps)
    assert "TP size: actors report tp_rank [0, 1] (TP=2), expected TP=4" in msg


def test_wrong_shape_and_dtype_named():
    ps = _participants("vllm", DST, Role.DESTINATION)
    tensors = list(ps[1].meta.tensors)
    t0 = tensors[0]
    tensors[0] = LocalTensorMeta(name=t0.name, shape=(t0.shape[0] + 1, *t0.shape[1:]), dtype=t0.dtype)
    tensors[1] = dataclasses.replace(tensors[1], dtype="int32")  # no cast between int and float
    ps[1] = _with_meta(ps[1], tensors=tuple(tensors))
    msg = _refused(_ref("vllm", tp=2, ep=2, replicas=2), Role.DESTINATION, ps)
    assert f"tensor {t0.name} has shape [{t0.shape[0] + 1}, " in msg and "manifest says" in msg
    assert f"tensor {tensors[1].name} has dtype int32, manifest says bfloat16: no cast is defined" in msg
    assert "rank replica=0,pp=0,tp=1 (actor p-1)" in msg


def test_destination_float_dtypes_become_casts_other_pairs_are_refused():
    ps = _participants("vllm", DST, Role.DESTINATION)
    norm = "model.layers.0.input_layernorm.weight"  # canonical and vLLM name agree
    fused = "model.layers.0.self_attn.qkv_proj.weight"  # q, k and v: three canonical tensors
    changed = {norm: "float32", fused: "float16"}
    tensors = tuple(dataclasses.replace(t, dtype=changed.get(t.name, t.dtype)) for t in ps[0].meta.tensors)
    ps[0] = _with_meta(ps[0], tensors=tensors)
    side = check_side(_ref("vllm", tp=2, ep=2, replicas=2), Role.DESTINATION, ps, MANIFEST)
    qkv = {f"model.layers.0.self_attn.{x}_proj.weight": "bfloat16" for x in "qkv"}
    assert dict(side.participants[0].wire_dtypes) == {norm: "bfloat16", **qkv}
    assert all(p.wire_dtypes == () for p in side.participants[1:])
    # fp8 on a destination is not a float cast; an integer tensor is none either
    ps[1] = _with_meta(
        ps[1], tensors=tuple(dataclasses.replace(t, dtype="float8_e4m3fn") for t in ps[1].meta.tensors)
    )
    msg = _refused(_ref("vllm", tp=2, ep=2, replicas=2), Role.DESTINATION, ps)
    assert (
        f"rank replica=0,pp=0,tp=1 (actor p-1): tensor {norm} has dtype float8_e4m3fn, manifest says" in msg
    )


def test_source_dtype_differing_from_the_manifest_is_refused():
    # The manifest's dtype is the wire's: a source sends its own bytes and never casts.
    ps = _participants("megatron", SRC, Role.SOURCE)
    name = ps[0].meta.tensors[0].name
    tensors = (dataclasses.replace(ps[0].meta.tensors[0], dtype="float32"), *ps[0].meta.tensors[1:])
    ps[0] = _with_meta(ps[0], tensors=tensors)
    msg = _refused(_ref("megatron", tp=2, pp=2, ep=2), Role.SOURCE, ps)
    assert f"tensor {name} has dtype float32, manifest says bfloat16 (a source sends its own bytes" in msg


def test_wrong_role_layout_and_expert_rank_named():
    ps = _participants("megatron", SRC, Role.SOURCE)
    ps[0] = _with_meta(ps[0], layout="hf")
    ps[1] = _with_meta(ps[1], coord=dataclasses.replace(ps[1].meta.coord, ep_rank=0))
    msg = _refused(_ref("megatron", tp=2, pp=2, ep=2), Role.SOURCE, ps)
    assert "actor p-0 reports layout 'hf', expected 'megatron'" in msg
    assert "rank pp=0,dp=0,tp=1 (actor p-1): ep_rank=0, expected 1" in msg


def test_deployments_on_two_ray_clusters_refused():
    src = _ref("megatron")
    other = DeploymentRef(name="e", ray_address="other:6379", actor_prefix="q-", layout="vllm")
    spec = WeightSyncSpec(source=src, destinations=[other], version="v1")
    with pytest.raises(RayUnreachableError, match="share one Ray cluster") as e:
        connect_ray(spec)
    assert e.value.to_failure().reason == Reason.RAY_UNREACHABLE == "RayClusterUnreachable"


# ---- end to end: refused before any byte moves ---------------------------------------------


class ShortDestination(DemoDestination):
    """Holds one tensor with a row too few: what a misconfigured inference engine would report."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        st = self._ws_state()
        name = sorted(n for n in st.tensors if "qkv_proj" in n)[0]
        st.tensors[name] = st.tensors[name][:-1].clone()
        self.ws_init(role=Role.DESTINATION, coord=st.coord, layout="vllm", tensors=st.tensors, version="v0")


@pytest.fixture(scope="module")
def address(local_ray: str) -> str:
    return local_ray


def _refused_sync(spec: WeightSyncSpec, setup: DemoSetup, *needles: str) -> None:
    report = Coordinator(spec, NullReporter(), manifest=setup.manifest).sync("v1")
    assert report.result is SyncResult.FAILED
    assert report.failure.reason == Reason.TOPOLOGY_MISMATCH and report.failure.step is SyncStep.DISCOVER
    assert not report.failure.retryable  # the loop waits for a new spec instead of retrying
    for needle in needles:
        assert needle in report.failure.message, report.failure.message
    assert report.moved_bytes == 0 and report.stages.transfer == 0 and report.planned_bytes == 0
    assert {p.meta.version for p in destination_participants(setup)} == {"v0"}  # untouched


def test_refused_wrong_tp_then_missing_rank(address):
    setup = DemoSetup.create("tiny-llama", "tp=2", "tp=1", namespace="t-topo")
    try:
        create_participants(setup, src_version="v1", dst_version="v0")
        wrong_tp = weightsync_spec(setup, "v1", address=address, src=ParallelSpec(tp=1))
        _refused_sync(
            wrong_tp,
            setup,
            "TP size: actors report tp_rank [0, 1] (TP=2), expected TP=1",
            "unexpected rank pp=0,dp=0,tp=1",
        )
        name = source_name(setup.src_prefix, RankCoord(role=Role.SOURCE, tp_rank=1))
        ray.kill(ray.get_actor(name, namespace=setup.namespace), no_restart=True)
        _wait_gone(setup.namespace, name)
        spec = weightsync_spec(setup, "v1", address=address)
        _refused_sync(spec, setup, "missing rank pp=0,dp=0,tp=1")
    finally:
        kill_participants(setup)


def test_refused_wrong_tensor_shape(address):
    setup = DemoSetup.create("tiny-llama", "tp=1", "tp=2", namespace="t-shape")
    try:
        create_participants(
            setup,
            src_version="v1",
            dst_version="v0",
            dest_class=lambda c: ShortDestination if c.tp_rank == 1 else DemoDestination,
        )
        spec = weightsync_spec(setup, "v1", address=address)
        _refused_sync(spec, setup, "rank replica=0,pp=0,tp=1", "qkv_proj.weight has shape", "manifest says")
    finally:
        kill_participants(setup)


def _wait_gone(namespace: str, name: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
        if (namespace, name) not in names:
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} still listed {timeout_s}s after ray.kill")


def test_a_dense_models_expert_coordinates_are_neither_compared_nor_kept():
    """Megatron's default expert_tensor_parallel_size is TP, for a dense model too (etp_rank=1
    at TP rank 1): that places nothing there. Control: the same coordinate on a MoE model is
    refused (test_wrong_role_layout_and_expert_rank_named)."""
    dense = build_manifest(load_model_config("tiny-qwen3"))
    spec = ParallelSpec(tp=2)
    ps = []
    for i, c in enumerate(enumerate_ranks(spec, Role.SOURCE)):
        meta = ParticipantMeta(
            role=Role.SOURCE, coord=dataclasses.replace(c, etp_rank=c.tp_rank), layout="megatron",
            tensors=get_layout("megatron").shard(dense, spec, c).tensors, node_ip="10.0.0.1", device="cpu",
            pid=100 + i, actor_name=f"p-{i}", actor_id=f"id{i}", version="v0", group_name=None,
            group_healthy=False,
        )  # fmt: skip
        ps.append(Participant(handle=None, name=f"p-{i}", namespace="ns", meta=meta))
    side = check_side(_ref("megatron", tp=2), Role.SOURCE, ps, dense)
    assert [p.meta.coord.etp_rank for p in side.participants] == [0, 0]
    moe = _participants("megatron", SRC, Role.SOURCE)
    moe[1] = _with_meta(moe[1], coord=dataclasses.replace(moe[1].meta.coord, etp_rank=1))
    assert "etp_rank=1, expected 0" in _refused(_ref("megatron", tp=2, pp=2, ep=2), Role.SOURCE, moe)
