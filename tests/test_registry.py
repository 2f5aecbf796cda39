"""Registration end to end against a real Ray cluster: unnamed actors (no prefix could find them)
take part in a sync once registered with their deployment, from the driver or from inside the
actor itself, and the destinations end bit-exact on the source's weights.

The tests share one set of actors and run in order (the second kills a source).
Controls: before registration discovery finds nobody and says so; a registered actor killed
since is dropped and its rank reported missing (nothing moves); registering under another
deployment name does not make an actor a participant of this one.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import ray

from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import DiscoveryError, TopologyMismatchError
from sync_runtime.runtime.discovery import gather
from sync_runtime.runtime.registry import REGISTRY_NAME, register, registered, unregister
from sync_runtime.testing.cluster import DemoSetup, weightsync_spec
from sync_runtime.testing.weights import DemoDestination, DemoSource, expected_sha256
from sync_runtime.trainer import InProcessSync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
NS = "t-registry"


def _start(setup: DemoSetup, role: Role, cls: type, version: str) -> list[Any]:
    """Unnamed actors, one per rank: nothing but a registration can find them."""
    spec = setup.src if role is Role.SOURCE else setup.dst
    remote = ray.remote(cls).options(namespace=setup.namespace, num_cpus=0)
    handles = [remote.remote(setup.config, spec, c, setup.seed, version) for c in _coords(spec, role)]
    ray.get([h.ws_version.remote() for h in handles], timeout=180)
    return handles


def _coords(spec: ParallelSpec, role: Role) -> list[RankCoord]:
    """The ranks as they run here: on this node, on the CPU (enumerate_ranks places them on
    synthetic GPU nodes)."""
    here = RankCoord(role=role)
    return [dataclasses.replace(c, node=here.node, device=here.device) for c in enumerate_ranks(spec, role)]


def _register_itself(handle: Any, deployment: str) -> int:
    """The actor registers itself, from inside (the call a trainer puts in its own setup)."""
    return int(ray.get(handle.__ray_call__.remote(lambda self: register(deployment, namespace=NS))))


@pytest.fixture(scope="module")
def setup(local_ray: str) -> Any:
    s = DemoSetup.create(
        "tiny-llama", "tp=2", "tp=2", namespace=NS, src_prefix="nobody-src-", dst_prefix="nobody-dst-"
    )
    sources = _start(s, Role.SOURCE, DemoSource, "v1")
    dests = _start(s, Role.DESTINATION, DemoDestination, "v0")
    yield s, sources, dests, weightsync_spec(s, "v1", address=local_ray)
    for h in [*sources, *dests]:
        ray.kill(h, no_restart=True)
    for deployment in ("trainer", "inference", "elsewhere"):
        unregister(deployment, namespace=NS)


def test_registered_unnamed_actors_sync_bit_exact(setup: Any) -> None:
    s, sources, dests, spec = setup
    with pytest.raises(DiscoveryError, match="no actors registered for 'trainer'"):
        gather(spec.source, 30)  # control: unnamed actors are invisible until registered
    assert register("elsewhere", sources, namespace=NS) == 2
    with pytest.raises(DiscoveryError, match="no actors registered for 'trainer'"):
        gather(spec.source, 30)  # control: another deployment's registration does not count
    assert [_register_itself(h, "trainer") for h in sources] == [1, 2]
    assert _register_itself(sources[0], "trainer") == 2  # registering again keeps one entry
    assert register("inference", dests, namespace=NS) == 2
    assert {r.name.split("@")[0] for r in registered(NS, "inference")} == {"inference"}
    with InProcessSync(spec) as sync:
        report = sync.push("v1")
    assert report.version == "v1" and report.moved_bytes > 0
    for handle, coord in zip(dests, _coords(s.dst, Role.DESTINATION), strict=True):
        want = expected_sha256(s.manifest, "vllm", s.dst, coord, s.seed, "v1")
        assert ray.get(handle.ws_sha256.remote()) == want, coord
        assert ray.get(handle.ws_version.remote()) == "v1"


def test_dead_registered_actor_is_dropped_and_its_rank_missing(setup: Any) -> None:
    _, sources, dests, spec = setup  # registered, synced to v1 by the test above
    ray.kill(sources[1], no_restart=True)
    with (
        InProcessSync(spec) as sync,
        pytest.raises(TopologyMismatchError, match="missing rank pp=0,dp=0,tp=1"),
    ):
        sync.push("v2")
    assert sync.last_report is not None and sync.last_report.moved_bytes == 0  # nothing moved
    assert len(registered(NS, "trainer")) == 1  # the dead registration is gone
    assert [ray.get(h.ws_version.remote()) for h in dests] == ["v1", "v1"]
    assert ray.get_actor(REGISTRY_NAME, namespace=NS) is not None
