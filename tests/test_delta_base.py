"""Which replicas a sync sends deltas to (runtime/delta_base.py), and the report's summary."""

from __future__ import annotations

import dataclasses

import pytest

from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.runtime.commit import Dest
from sync_runtime.runtime.delta_base import delta_bases, summary
from sync_runtime.runtime.discovery import Participant
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.report import ReplicaState, ReplicaVersion
from sync_runtime.transfer import RankResult

pytestmark = pytest.mark.unit

DST = ParallelSpec(tp=2, replicas=2)  # ranks 1, 2 (replica 0) and 3, 4 (replica 1); rank 0 is the source


def _spec(delta: str = "auto", staging: str | None = None) -> WeightSyncSpec:
    dep = {"rayAddress": "x:1", "actorPrefix": "p-", "layout": "megatron", "parallelism": {"tp": 1}}
    dest = {**dep, "name": "inference", "layout": "vllm", "parallelism": {"tp": 2, "replicas": 2}}
    if staging:
        dest["staging"] = staging
    return WeightSyncSpec.model_validate(
        {"source": {**dep, "name": "trainer"}, "destinations": [dest], "version": "v2",
         "transport": {"delta": delta}}
    )  # fmt: skip


def _dests(live_base: bool = True) -> list[Dest]:
    out = []
    for i, c in enumerate(enumerate_ranks(DST, Role.DESTINATION)):
        meta = ParticipantMeta(
            role=Role.DESTINATION, coord=c, layout="vllm", tensors=(), node_ip="10.0.0.1", device="cpu",
            pid=i, actor_name=f"d{i}", actor_id=f"id{i}", version="v1", group_name=None,
            group_healthy=False, live_base=live_base,
        )  # fmt: skip
        out.append(
            Dest(1 + i, Participant(handle=None, name=f"d{i}", namespace="ns", meta=meta), "inference")
        )
    return out


def _replica(replica: int, versions: list[str | None]) -> ReplicaVersion:
    uniform = len(set(versions)) == 1 and versions[0] is not None
    state = ReplicaState.SERVING if uniform else ReplicaState.DEGRADED
    return ReplicaVersion(
        deployment="inference", replica=replica, version=versions[0] if uniform else None, state=state,
        rank_versions=versions,
    )  # fmt: skip


KEPT = ["v1"]  # the one source rank keeps the bits of v1
SERVING_V1 = [_replica(0, ["v1", "v1"]), _replica(1, ["v1", "v1"])]


def test_every_rank_of_a_replica_on_the_base_takes_deltas() -> None:
    assert delta_bases(_spec(), _dests(), SERVING_V1, "gloo", relay=False, kept=KEPT) == {
        1: "v1",
        2: "v1",
        3: "v1",
        4: "v1",
    }


def test_a_replica_whose_ranks_disagree_takes_the_sync_in_full() -> None:
    replicas = [_replica(0, ["v1", "v1"]), _replica(1, ["v1", "v0"])]
    assert delta_bases(_spec(), _dests(), replicas, "gloo", relay=False, kept=KEPT) == {1: "v1", 2: "v1"}
    replicas = [_replica(0, ["v0", "v0"]), _replica(1, ["v1", None])]  # a rank did not answer
    assert delta_bases(_spec(), _dests(), replicas, "gloo", relay=False, kept=["v0"]) == {1: "v0", 2: "v0"}


@pytest.mark.parametrize(
    ("spec", "backend", "relay", "live_base"),
    [
        (_spec(delta="off"), "gloo", False, True),
        (_spec(), "nccl", False, True),
        (_spec(), "gloo", True, True),
        (_spec(staging="inplace"), "gloo", False, True),
        (_spec(), "gloo", False, False),  # the vLLM worker's staging: no readable live bytes
    ],
    ids=["off", "nccl", "relay", "inplace", "no-live-base"],
)
def test_full_syncs_where_a_delta_cannot_be_rebuilt(spec, backend: str, relay: bool, live_base: bool) -> None:
    assert delta_bases(spec, _dests(live_base), SERVING_V1, backend, relay, KEPT) == {}


def test_deltas_only_against_the_version_every_source_rank_keeps() -> None:
    """No kept copy (a restarted source, the first sync), copies of different versions, or one of
    another version than the replicas hold: the sync goes in full (zero-copy, no delta format)."""
    for kept in ([None], ["v1", None], ["v1", "v0"], ["v0"]):
        assert delta_bases(_spec(), _dests(), SERVING_V1, "gloo", relay=False, kept=kept) == {}, kept
    assert delta_bases(_spec(), _dests(), SERVING_V1, "gloo", relay=False, kept=["v1", "v1"]) != {}


def test_a_rank_that_casts_on_receipt_keeps_its_replica_in_full() -> None:
    dests = _dests()
    dests[3] = dataclasses.replace(
        dests[3], p=dataclasses.replace(dests[3].p, wire_dtypes=(("w", "bfloat16"),))
    )
    assert delta_bases(_spec(), dests, SERVING_V1, "gloo", relay=False, kept=KEPT) == {1: "v1", 2: "v1"}


def _result(
    rank: int, sent: int, wire: int, deltas: int, dense: int, elements: int, changed: int
) -> RankResult:
    r = RankResult(rank, True, sent, 0, 0.1, wire_bytes=wire, delta_transfers=deltas, dense_transfers=dense)
    r.delta_elements, r.delta_changed = elements, changed
    return r


def test_summary_names_the_encoding_from_what_went_on_the_wire() -> None:
    dests = _dests()
    every = {1: "v1", 2: "v1", 3: "v1", 4: "v1"}
    deltas = [_result(0, 1000, 60, 4, 0, 500, 15)]
    assert summary(deltas, dests, every) == {
        "encoding": "delta", "wire_bytes": 60, "full_bytes": 1000, "changed_fraction": 0.03
    }  # fmt: skip
    assert summary(deltas, dests, {1: "v1", 2: "v1"})["encoding"] == "mixed"  # replica 1 in full
    assert summary([_result(0, 1000, 700, 3, 1, 500, 15)], dests, every)["encoding"] == "mixed"  # one dense
    no_base = summary([_result(0, 1000, 1040, 0, 4, 0, 0)], dests, every)  # the source kept nothing
    assert no_base["encoding"] == "full" and no_base["changed_fraction"] is None
