"""Discovery learns whether a side holds the MTP part from what its ranks report: a vLLM engine
with an MTP drafter reports the drafter's tensors, the plan then sends it the MTP part; an engine
without reports none and gets none; ranks that disagree are refused in one line. Pure: reported
metas built from the layouts' shards, as test_discovery.py builds them."""

from __future__ import annotations

import dataclasses

import pytest

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.errors import TopologyMismatchError
from sync_runtime.planner import PlannerConfig, plan_sync
from sync_runtime.runtime.discovery import Participant, check_side, topology_digest
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.schema.crd import DeploymentRef, Parallelism

pytestmark = pytest.mark.unit

MANIFEST = build_manifest(load_model_config("tiny-deepseek-v3"))
DRAFTER_EH_PROJ = "drafter.model.layers.3.eh_proj.weight"


def _ref(layout: str, name: str, **par: int) -> DeploymentRef:
    return DeploymentRef(
        name=name, ray_address="x:1", actor_prefix="p-", layout=layout, parallelism=Parallelism(**par)
    )


def _participants(layout: str, spec: ParallelSpec, role: Role, held: Manifest) -> list[Participant]:
    """Ranks reporting the shard of `held` (with_mtp(): an engine with a drafter)."""
    out = []
    for i, c in enumerate(enumerate_ranks(spec, role)):
        tensors = get_layout(layout).shard(held, spec, c).tensors
        meta = ParticipantMeta(
            role=role, coord=c, layout=layout, tensors=tensors, node_ip="10.0.0.1", device="cpu",
            pid=100 + i, actor_name=f"p-{i}", actor_id=f"id{i}", version="v0", group_name=None,
            group_healthy=False,
        )  # fmt: skip
        out.append(Participant(handle=None, name=f"p-{i}", namespace="ns", meta=meta))
    return out


def test_a_destination_reporting_drafter_tensors_serves_mtp_and_is_planned_it() -> None:
    spec = ParallelSpec(tp=2, pp=2)
    ref = _ref("vllm", "dst", tp=2, pp=2)
    side = check_side(
        ref, Role.DESTINATION, _participants("vllm", spec, Role.DESTINATION, MANIFEST.with_mtp()), MANIFEST
    )
    plain = check_side(
        ref, Role.DESTINATION, _participants("vllm", spec, Role.DESTINATION, MANIFEST), MANIFEST
    )
    assert side.mtp and side.side_spec().mtp
    assert not plain.mtp and not plain.side_spec().mtp  # negative control: no drafter, no MTP
    sources = _participants("hf", ParallelSpec(tp=2), Role.SOURCE, MANIFEST.with_mtp())
    src = check_side(_ref("hf", "src", tp=2), Role.SOURCE, sources, MANIFEST)
    assert src.mtp
    plan = plan_sync(MANIFEST, src.side_spec(), [side.side_spec(), plain.side_spec()], PlannerConfig())
    assert plan.stats["side_mtp_bytes"][0] > 0 and plan.stats["side_mtp_bytes"][1] == 0
    # A side serving MTP plans otherwise: the topology digest says so; one without keeps its digest.
    assert topology_digest(MANIFEST, [src, side]) != topology_digest(
        MANIFEST, [src, dataclasses.replace(side, mtp=False)]
    )


def test_ranks_that_disagree_are_refused_in_one_line() -> None:
    spec = ParallelSpec(tp=2)
    ranks = _participants("vllm", spec, Role.DESTINATION, MANIFEST.with_mtp())
    ranks[1] = _participants("vllm", spec, Role.DESTINATION, MANIFEST)[1]  # tp rank 1 has no drafter
    with pytest.raises(TopologyMismatchError) as e:
        check_side(_ref("vllm", "dst", tp=2), Role.DESTINATION, ranks, MANIFEST)
    message = str(e.value)
    assert "\n" not in message and "MTP" in message
    assert "rank replica=0,pp=0,tp=0" in message and "but not by rank replica=0,pp=0,tp=1" in message


def test_a_drafter_tensor_missing_on_a_serving_rank_is_named() -> None:
    # The rank reports some drafter tensors, so it serves MTP; the one it lacks is named.
    spec = ParallelSpec(tp=1)
    ranks = _participants("vllm", spec, Role.DESTINATION, MANIFEST.with_mtp())
    meta = ranks[0].meta
    tensors = tuple(t for t in meta.tensors if t.name != DRAFTER_EH_PROJ)
    ranks[0] = dataclasses.replace(ranks[0], meta=dataclasses.replace(meta, tensors=tensors))
    with pytest.raises(TopologyMismatchError, match=f"missing tensor {DRAFTER_EH_PROJ}"):
        check_side(_ref("vllm", "dst", tp=1), Role.DESTINATION, ranks, MANIFEST)


def test_a_model_without_mtp_never_serves_it() -> None:
    plain = build_manifest(load_model_config("tiny-deepseek-v3") | {"num_nextn_predict_layers": 0})
    assert not plain.mtp
    side = check_side(_ref("vllm", "dst", tp=1), Role.DESTINATION,
                      _participants("vllm", ParallelSpec(tp=1), Role.DESTINATION, plain), plain)  # fmt: skip
    assert not side.mtp
