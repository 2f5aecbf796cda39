"""Per-tensor dtypes through the transfer engine on real processes and real gloo: the wire carries
the source's bytes, the receiving rank casts once into its own dtype (docs/dtypes.md).

Rank 0 is the source (fp32 `N`, bf16 `W` and `H`). Rank 1 holds `N` as bf16 (a narrowing),
`W` as fp32 (a widening) and `H` as fp16, and relays its fp32 `w` to rank 2, which holds `W` in
its wire dtype bf16 (the relay casts back when it packs).
"""

from __future__ import annotations

import pytest
import torch

from sync_runtime.core.plan import Bucket, Round, SyncPlan, Transfer
from sync_runtime.core.topology import RankCoord, Role
from sync_runtime.errors import Reason
from sync_runtime.testing import faults
from sync_runtime.testing.local_ranks import LocalWorld, RankContext
from sync_runtime.transfer import DestinationWeights, SyncGroup, TransferConfig, run_rank_plan

pytestmark = pytest.mark.e2e

WORLD = 3
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASTS = (("H", "bfloat16"), ("N", "float32"), ("W", "bfloat16"))
"""What discovery hands rank 1: canonical tensor -> wire dtype."""
DEFAULT_DIRECT = TransferConfig().direct_min_bytes


def _t(
    src: int, dst: int, tensor: str, src_box, dst_name: str, dst_box, elem: int, src_name: str = ""
) -> Transfer:
    n = 1
    for a, b in src_box:
        n *= b - a
    return Transfer(src, dst, tensor, src_name or tensor, tuple(src_box), dst_name, tuple(dst_box), n * elem)


def _bucket(*ts: Transfer) -> Bucket:
    return Bucket(ts[0].src_rank, ts[0].dst_rank, ts, sum(t.nbytes for t in ts))


def plan() -> SyncPlan:
    r0 = Round((_bucket(
        _t(0, 1, "N", [(0, 6), (0, 8)], "n", [(0, 6), (0, 8)], 4),
        _t(0, 1, "N", [(0, 6), (0, 3)], "n_cols", [(0, 6), (0, 3)], 4),  # strided at the source
        _t(0, 1, "W", [(0, 8), (0, 4)], "w", [(0, 8), (0, 4)], 2),
        _t(0, 1, "H", [(0, 5)], "h", [(0, 5)], 2),
    ),))  # fmt: skip
    r1 = Round((_bucket(_t(1, 2, "W", [(0, 8), (0, 4)], "w2", [(0, 8), (0, 4)], 2, src_name="w")),))
    ranks = (
        RankCoord(role=Role.SOURCE),
        RankCoord(role=Role.DESTINATION),
        RankCoord(role=Role.DESTINATION, tp_rank=1),
    )
    return SyncPlan(ranks=ranks, rounds=(r0, r1), digest="cast-plan-1", relay=True)


def sources(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # fp32 values with low mantissa bits set: the narrowing to bf16 really rounds
    n = torch.randn(6, 8, generator=g) * 3
    return {"N": n, "W": torch.randn(8, 4, generator=g).to(BF16), "H": torch.randn(5, generator=g).to(BF16)}


def destination(rank: int) -> DestinationWeights:
    shapes = {
        1: {"n": ((6, 8), BF16), "n_cols": ((6, 3), BF16), "w": ((8, 4), F32), "h": ((5,), F16)},
        2: {"w2": ((8, 4), BF16)},
    }
    return DestinationWeights({n: torch.full(s, 7.0, dtype=d) for n, (s, d) in shapes[rank].items()}, "v0")


def rank_main(ctx: RankContext, seed: int, casts: tuple, direct: int, corrupt: bool) -> dict:
    group = SyncGroup.connect(store_host=ctx.store_host, store_port=ctx.store_port, rank=ctx.rank,
                              world_size=WORLD, backend="gloo", timeout_s=10.0,
                              group_name=ctx.group_name)  # fmt: skip
    config = TransferConfig(
        timeout_s=10.0, direct_min_bytes=direct, wire_dtypes=casts if ctx.rank == 1 else ()
    )
    hooks = faults.corrupt_after_pack(offset=0, mask=0x01) if corrupt and ctx.rank == 0 else None
    dest = destination(ctx.rank) if ctx.rank else None
    if dest is not None:
        dest.begin("v1")
    src = sources(seed) if ctx.rank == 0 else None
    result = run_rank_plan(group, plan().for_rank(ctx.rank), sources=src, destination=dest, config=config,
                           hooks=hooks)  # fmt: skip
    group.close()
    report: dict = {"ok": result.ok, "failure": result.failure}
    if dest is not None and result.ok:
        dest.commit()
        report["tensors"] = {n: t.clone() for n, t in dest.tensors.items()}
    return report


@pytest.fixture
def world(rank_pool: LocalWorld) -> LocalWorld:
    """The session's shared rank pool (tests/conftest.py): these tests kill no rank."""
    return rank_pool


def _run(
    world: LocalWorld, casts: tuple = CASTS, direct: int = DEFAULT_DIRECT, corrupt: bool = False
) -> list:
    outcomes = world.run(rank_main, [(11, casts, direct, corrupt)] * WORLD, timeout_s=60)
    assert all(o.error is None and o.exitcode is None for o in outcomes), outcomes
    return [o.value for o in outcomes]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("direct", [DEFAULT_DIRECT, 0])  # all packed / each its own message
def test_receiving_rank_casts_once_bits_equal_src_to_dst_dtype(world: LocalWorld, direct: int) -> None:
    reports = _run(world, direct=direct)
    assert [r["ok"] for r in reports] == [True, True, True], reports
    src, got = sources(11), reports[1]["tensors"]
    assert _same(got["n"], src["N"].to(BF16))  # fp32 -> bf16
    assert _same(got["n_cols"], src["N"][:, :3].to(BF16))
    assert _same(got["w"], src["W"].to(F32))  # bf16 -> fp32, exact
    assert _same(got["h"], src["H"].to(F16))  # bf16 -> fp16
    assert _same(reports[2]["tensors"]["w2"], src["W"])  # relayed from fp32 staging, cast back
    # the narrowing is a real one (it changed bits), so the checks above could fail
    assert not torch.equal(got["n"].to(F32), src["N"])


def test_without_the_cast_the_bits_are_reinterpreted_or_refused(world: LocalWorld) -> None:
    # Negative control 1: no cast for H (bf16 wire, fp16 staging, same size): the bytes land as they
    # are, which gives other values than the cast.
    reports = _run(world, casts=(("N", "float32"), ("W", "bfloat16"), ("H", "float16")))
    src = sources(11)
    h = reports[1]["tensors"]["h"]
    assert reports[1]["ok"] and torch.equal(_bits(h), _bits(src["H"]))  # raw bf16 bits as fp16
    assert not _same(h, src["H"].to(F16))
    # Negative control 2: no cast map at all: the fp32 wire into bf16 staging disagrees in size.
    reports = _run(world, casts=())
    failure = reports[1]["failure"]
    assert not reports[1]["ok"] and failure.reason == Reason.PLAN_MISMATCH, failure
    assert failure.tensor in ("N", "W") and "dtype disagrees with the manifest" in failure.message, failure


def test_checksum_covers_the_wire_bytes_before_the_cast(world: LocalWorld) -> None:
    # The flipped bit is the lowest mantissa bit of N[0, 0] in fp32: the cast to bf16 rounds it
    # away, so a checksum of the staged (cast) bytes could not see it. The wire's checksum does.
    n00 = sources(11)["N"][0, 0].view(1)
    flipped = (n00.view(torch.int32) ^ 1).view(F32)
    assert _same(flipped.to(BF16), n00.to(BF16))  # invisible after the cast
    reports = _run(world, corrupt=True)
    caught = reports[1]["failure"]
    assert caught is not None and (caught.reason, caught.tensor, caught.peer) == (
        Reason.CHECKSUM_MISMATCH,
        "N",
        0,
    )
