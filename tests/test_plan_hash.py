"""`PairBook.content_hash`: deterministic, and changed by any field of a need, pattern or pair.

The hash feeds the plan digest (programs are reused by digest), so a plan that moves different
bytes, from a different sender or into a different place must not share it. Each negative control
perturbs one field of a fresh plan's book; stability across processes is covered by the plan
digest's own test (test_planner_properties.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.planner.needs import Need
from sync_runtime.planner.pairs import PairBook
from sync_runtime.planner.program import CompactPrograms
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit


def _book() -> PairBook:
    """A fresh plan's book: MoE (holder sets of several sizes), small buckets (multi-bucket pairs)."""
    manifest = build_manifest(load_model_config("tiny-qwen3-moe"))
    src, dst = ParallelSpec.parse("tp=2,pp=2,dp=2,ep=2"), ParallelSpec.parse("tp=2,ep=2,replicas=2")
    plan = plan_sync(
        manifest,
        SideSpec("megatron", src, tuple(enumerate_ranks(src, Role.SOURCE))),
        [SideSpec("vllm", dst, tuple(enumerate_ranks(dst, Role.DESTINATION)))],
        PlannerConfig(bucket_bytes=2048, staging_budget_bytes=8192),
    )
    programs = plan._programs
    assert isinstance(programs, CompactPrograms)
    return programs.book


def _need(book: PairBook) -> Need:
    return book.patterns[0].needs[0]


def _grow(box: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    (lo, hi), *rest = box
    return ((lo, hi + 1), *rest)


def _split_bucket(book: PairBook) -> None:
    pattern = next(p for p in book.patterns if len(p.bounds) > 2)
    pattern.bounds[1] += 1


def _other_holders(book: PairBook) -> None:
    need = _need(book)
    need.cell = dataclasses.replace(need.cell, ranks=(*need.cell.ranks, max(book.pair_src) + 1))


PERTURB: dict[str, Callable[[PairBook], None]] = {
    "tensor": lambda b: setattr(_need(b), "tensor", _need(b).tensor + "x"),
    "canon_box": lambda b: setattr(_need(b), "canon_box", _grow(_need(b).canon_box)),
    "dst_name": lambda b: setattr(_need(b), "dst_name", _need(b).dst_name + "x"),
    "dst_box": lambda b: setattr(_need(b), "dst_box", _grow(_need(b).dst_box)),
    "nbytes": lambda b: setattr(_need(b), "nbytes", _need(b).nbytes + 1),
    "holder_set": _other_holders,
    "pattern_bound": _split_bucket,
    "pattern_order": lambda b: b.patterns[0].order.reverse(),
    "pair_src": lambda b: b.pair_src.__setitem__(0, b.pair_src[0] + 1),
    "pair_dst": lambda b: b.pair_dst.__setitem__(0, b.pair_dst[0] + 1),
}


def test_content_hash_is_deterministic_across_plans() -> None:
    first, again = _book(), _book()
    assert first is not again and first.patterns[0].needs is not again.patterns[0].needs
    assert first.content_hash() == again.content_hash()
    assert first.content_hash() == first.content_hash()  # hashing reads, never changes, the book


@pytest.mark.parametrize("field", sorted(PERTURB))
def test_content_hash_changes_with_each_field(field: str) -> None:
    book = _book()
    before = book.content_hash()
    PERTURB[field](book)
    assert book.content_hash() != before
