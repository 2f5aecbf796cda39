"""The transfer engine on real processes and real gloo, with hand-built plans: the happy path
(two rounds, mixed dtypes, a strided source region, a relay, the warm path) and faults.

Rank 0 is the source; ranks 1 and 2 are destinations; rank 1 also relays `b` to rank 2.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import pytest
import torch

from sync_runtime.core.plan import Bucket, Round, SyncPlan, Transfer
from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.errors import Reason, SyncStep
from sync_runtime.testing import faults
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.transfer import DestinationWeights, EngineHooks, SyncGroup, TransferConfig, run_rank_plan

pytestmark = pytest.mark.e2e

WORLD = 3
DEFAULT_DIRECT = TransferConfig().direct_min_bytes
"""Every hand-plan transfer is smaller: all packed. direct=0 sends each as its own message
(zero-copy from the source where contiguous, into staging where contiguous, bounced otherwise)."""


def _t(
    src: int, dst: int, tensor: str, src_name: str, src_box, dst_name: str, dst_box, elem: int = 2
) -> Transfer:
    n = 1
    for a, b in src_box:
        n *= b - a
    return Transfer(src, dst, tensor, src_name, tuple(src_box), dst_name, tuple(dst_box), n * elem)


def _bucket(*ts: Transfer) -> Bucket:
    return Bucket(ts[0].src_rank, ts[0].dst_rank, ts, sum(t.nbytes for t in ts))


def hand_plan() -> SyncPlan:
    r0 = Round((
        _bucket(_t(0, 1, "A", "A", [(0, 4), (0, 6)], "a_top", [(0, 4), (0, 6)]),
                _t(0, 1, "B", "B", [(0, 5)], "b", [(0, 5)], elem=4)),
        _bucket(_t(0, 2, "A", "A", [(4, 8), (0, 6)], "a_bot", [(0, 4), (0, 6)])),
    ))  # fmt: skip
    r1 = Round((
        _bucket(_t(0, 2, "A", "A", [(0, 8), (0, 3)], "a_cols", [(0, 8), (0, 3)])),
        _bucket(_t(1, 2, "B", "b", [(0, 5)], "b2", [(0, 1), (0, 5)], elem=4)),
    ))  # fmt: skip
    ranks = (
        RankCoord(role=Role.SOURCE),
        RankCoord(role=Role.DESTINATION),
        RankCoord(role=Role.DESTINATION, tp_rank=1),
    )
    return SyncPlan(ranks=ranks, rounds=(r0, r1), digest="hand-plan-1", relay=True)


def source_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"A": torch.randn(8, 6, generator=g).to(torch.bfloat16), "B": torch.randn(5, generator=g)}


def expected(rank: int, seed: int) -> dict[str, torch.Tensor]:
    src = source_tensors(seed)
    a, b = src["A"], src["B"]
    if rank == 1:
        top = torch.zeros(6, 6, dtype=torch.bfloat16)
        top[:4] = a[:4]  # rows 4..5: padding, zero after every sync
        return {"a_top": top, "b": b}
    return {"a_bot": a[4:].clone(), "a_cols": a[:, :3].clone(), "b2": b.view(1, 5).clone()}


def initial_destination(rank: int) -> DestinationWeights:
    bf16, f32 = torch.bfloat16, torch.float32
    shapes = {1: {"a_top": ((6, 6), bf16), "b": ((5,), f32)},
              2: {"a_bot": ((4, 6), bf16), "a_cols": ((8, 3), bf16), "b2": ((1, 5), f32)}}  # fmt: skip
    tensors = {n: torch.full(s, 7.0, dtype=d) for n, (s, d) in shapes[rank].items()}
    return DestinationWeights(tensors, version="v0")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


class RaisingSources(Mapping[str, torch.Tensor]):
    """A source whose memory is gone: every access raises (e.g. the trainer freed the buffers)."""

    def __getitem__(self, key: str) -> torch.Tensor:
        raise RuntimeError(f"source tensor {key} is unavailable")

    def __iter__(self) -> Iterator[str]:
        return iter(["A", "B"])

    def __len__(self) -> int:
        return 2


def _to_rank2_in_round0(round_index: int, bucket: Bucket) -> bool:
    return round_index == 0 and bucket.dst_rank == 2


def _hooks(fault: str, rank: int) -> EngineHooks | None:
    if fault == "corrupt" and rank == 0:
        return faults.corrupt_after_pack(offset=5, mask=0x01, only=_to_rank2_in_round0)
    if fault == "dest_exit" and rank == 2:
        return faults.exit_before_round(1, code=17)
    return None


CONNECT_S = 60.0
"""The group's rendezvous timeout (not the transfer timeout under test)."""


def rank_main(ctx: RankContext, seeds: list[int], fault: str, timeout_s: float, direct: int) -> list[dict]:
    """One participant: connect once, run one sync per seed on the same group, report each."""
    hooks = _hooks(fault, ctx.rank)
    # The rendezvous gets its own, longer timeout: the faults' 2 s transfer timeout is the engine's
    # (TransferConfig), and a loaded 2-core machine once took longer than 2 s to connect (CI run).
    group = SyncGroup.connect(store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank,
                              world_size=WORLD, backend="gloo", timeout_s=max(timeout_s, CONNECT_S),
                              group_name=ctx.group_name)  # fmt: skip
    plan = hand_plan().for_rank(ctx.rank)
    config = TransferConfig(timeout_s=timeout_s, direct_min_bytes=direct)
    dest = initial_destination(ctx.rank) if ctx.rank else None
    reports = []
    for seed in seeds:
        if fault == "silent" and ctx.rank == 0:
            time.sleep(timeout_s + 2.0)  # never sends; stays alive so peers see a timeout, not a reset
            reports.append({"ok": None})
            continue
        sources = RaisingSources() if fault == "raise" and ctx.rank == 0 else source_tensors(seed)
        before = dest.checksums() if dest else {}
        if dest:
            dest.begin(f"v{seed}")
        progress: list[tuple[int, int]] = []
        result = run_rank_plan(group, plan, sources=sources if ctx.rank in (0, 1) else None, destination=dest,
                               config=config, on_progress=lambda d, t, p=progress: p.append((d, t)),
                               hooks=hooks)  # fmt: skip
        report = {"ok": result.ok, "failure": result.failure, "seconds": result.seconds,
                  "send": result.send_bytes, "recv": result.recv_bytes, "healthy": group.healthy,
                  "progress": progress}  # fmt: skip
        if dest:
            if result.ok:
                report["version"] = dest.commit()
                want = expected(ctx.rank, seed)
                report["exact"] = all(torch.equal(_bits(dest.tensors[n]), _bits(w)) for n, w in want.items())
            else:
                dest.abort()
                report["unchanged"] = dest.checksums() == before and dest.version == "v0"
        reports.append(report)
        if not result.ok:
            break
    group.close()
    return reports


@pytest.fixture
def world(rank_pool: LocalWorld) -> LocalWorld:
    """Ranks 0..WORLD-1 of the session's pool (a rank this module kills is replaced after it)."""
    return rank_pool


def _run(
    world: LocalWorld,
    seeds: list[int],
    fault: str = "",
    timeout_s: float = 10.0,
    direct: int = DEFAULT_DIRECT,
) -> list[list[dict]]:
    outcomes = world.run(rank_main, [(seeds, fault, timeout_s, direct)] * WORLD, timeout_s=60)
    return [o.value if o.error is None and o.exitcode is None else o for o in outcomes]


@pytest.mark.parametrize("direct", [DEFAULT_DIRECT, 0])
def test_two_syncs_on_one_group_are_bit_exact(world: LocalWorld, direct: int) -> None:
    reports = _run(world, [1, 2], direct=direct)
    for per_sync in reports:
        assert isinstance(per_sync, list), per_sync
        assert [r["ok"] for r in per_sync] == [True, True], per_sync
        assert all(r["healthy"] for r in per_sync)
    for rank in (1, 2):
        assert [r["exact"] for r in reports[rank]] == [True, True]
        assert [r["version"] for r in reports[rank]] == ["v1", "v2"]
    assert reports[0][1]["send"] == 48 + 20 + 48 + 48 and reports[0][1]["recv"] == 0
    assert reports[1][1]["send"] == 20 and reports[1][1]["recv"] == 68
    assert reports[2][1]["recv"] == 48 + 48 + 20
    assert reports[2][1]["progress"][-1] == (116, 116)


def _assert_collective_failure(reports: list, survivors: list[int], timeout_s: float, bound_s: float) -> None:
    for rank in survivors:
        report = reports[rank][-1]
        assert report["ok"] is False, report
        assert report["seconds"] < bound_s, report
        failure = report["failure"]
        assert failure.rank == rank and failure.step is not None, failure
        assert "round" in failure.message and "Traceback" not in failure.message, failure
        assert not report["healthy"]
        if rank:
            assert report["unchanged"], report


def _blamed(reports: list, rank: int):
    """The failure at the root of `rank`'s: PeerFailed points at the peer, followed to its own."""
    failure, seen = reports[rank][-1]["failure"], {rank}
    while (
        failure.reason == Reason.PEER_FAILED
        and failure.peer not in seen
        and isinstance(reports[failure.peer], list)
    ):
        seen.add(failure.peer)
        failure = reports[failure.peer][-1]["failure"]
    return failure


@pytest.mark.parametrize("direct", [DEFAULT_DIRECT, 0])
def test_checksum_mismatch_fails_every_rank_and_keeps_live_weights(world: LocalWorld, direct: int) -> None:
    # direct=0: the flipped tail byte is in the checksum header, not in A's bytes; caught all the same.
    reports = _run(world, [3], fault="corrupt", timeout_s=4.0, direct=direct)
    _assert_collective_failure(reports, [0, 1, 2], 4.0, bound_s=2.0)
    caught = reports[2][0]["failure"]
    assert (caught.reason, caught.rank, caught.tensor, caught.peer) == (Reason.CHECKSUM_MISMATCH, 2, "A", 0)
    assert caught.step is SyncStep.VERIFY and "round 0" in caught.message, caught
    told = reports[0][0]["failure"]  # the sender learns who failed, and why, as fields
    assert (told.reason, told.rank, told.peer) == (Reason.PEER_FAILED, 0, 2), told
    assert "(ChecksumMismatch)" in told.message and _blamed(reports, 0) == caught, told


def test_source_that_raises_before_sending_fails_every_rank_fast(world: LocalWorld) -> None:
    reports = _run(world, [4], fault="raise", timeout_s=4.0)
    _assert_collective_failure(reports, [0, 1, 2], 4.0, bound_s=2.0)
    own = reports[0][0]["failure"]
    assert (own.reason, own.rank, own.peer) == (Reason.SOURCE_ERROR, 0, None), own
    assert "RuntimeError: source tensor A is unavailable" in own.message, own
    for rank in (1, 2):
        told = reports[rank][0]["failure"]
        assert (told.reason, told.rank, told.peer) == (Reason.PEER_FAILED, rank, 0), told
        assert _blamed(reports, rank) == own


def test_peer_that_never_sends_times_out_with_named_peer(world: LocalWorld) -> None:
    reports = _run(world, [5], fault="silent", timeout_s=2.0)
    _assert_collective_failure(reports, [1, 2], 2.0, bound_s=2.0 + 1.5)
    for rank in (1, 2):  # both wait on rank 0; the one that times out second may hear of the first
        waited = _blamed(reports, rank)
        assert (waited.reason, waited.peer, waited.step) == (Reason.TRANSFER_TIMEOUT, 0, SyncStep.TRANSFER)
        assert "round 0: recv from rank 0" in waited.message and "timed out after 2.0s" in waited.message


def test_destination_that_exits_mid_transfer(world: LocalWorld) -> None:
    # Last in the file on purpose: rank 2's process dies, which spends the module's pool
    # (a fresh pool would cost another torch import per rank, seconds on a small machine).
    reports = _run(world, [6], fault="dest_exit", timeout_s=4.0)
    assert reports[2].exitcode == 17
    _assert_collective_failure(reports, [0, 1], 4.0, bound_s=4.0 + 1.5)
    for rank in (0, 1):  # both send to rank 2 in round 1
        lost = _blamed(reports, rank)
        assert lost.peer == 2 and "round 1" in lost.message, lost
