"""A real Megatron-Core 0.19.2 DeepSeek-V3-like model with one MTP layer (GPTModel.mtp, local spec,
CPU, gloo) at TP 2 as the source of a sync into an `hf` destination (TP 2) that serves MTP, over
real torch.distributed processes. The MTP tensors (and the rest) arrive bit-exact against
Megatron-Core's own parameters converted by name (`engines.megatron_convert`, from each
parameter's partition attributes: not the layout under test). Negative control: one MTP source
parameter scrambled (eh_proj) fails the check on exactly that tensor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.manifest import MTP_PART
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import Role
from sync_runtime.engines.megatron_convert import gather_full, to_hf
from sync_runtime.runtime.discovery import Participant, check_side
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.schema.crd import DeploymentRef, Parallelism
from sync_runtime.testing.gloo_world import hold_rendezvous
from sync_runtime.testing.local_ranks import LocalWorld
from sync_runtime.testing.megatron_mtp import mtp_rank, sides

pytestmark = pytest.mark.engines

CONFIG = {**load_model_config("tiny-deepseek-v3"), "torch_dtype": "float32"}  # the trainer is fp32
DST = "tp=2"
EH_PROJ = "mtp.layers.0.eh_proj.weight"


@pytest.fixture(scope="module")
def world() -> Iterator[LocalWorld]:
    with LocalWorld(4) as w:  # 2 Megatron ranks + 2 destination ranks; own pool: ranks keep Megatron state
        yield w


def _sync(world: LocalWorld, src: str, scramble: str | None) -> list[dict[str, Any]]:
    args = (CONFIG, src, DST, hold_rendezvous(), scramble)
    outcomes = world.run(mtp_rank, [args] * 4, timeout_s=400)
    for o in outcomes:
        assert o.error is None and o.exitcode is None, o
        assert o.value["ok"], o.value
    return [o.value for o in outcomes]


def _participants(sources: list[dict[str, Any]], keep: list[set[str]] | None) -> list[Participant]:
    """The trainer ranks as discovery finds them (rank i's reported tensors named in keep[i])."""
    out = []
    for i, r in enumerate(sources):
        tensors = tuple(t for t in r["tensors"] if keep is None or t.name in keep[i])
        meta = ParticipantMeta(
            role=Role.SOURCE, coord=r["coord"], layout=r["layout"],
            tensors=tensors, node_ip="127.0.0.1", device="cpu",
            pid=i, actor_name=f"p-{i}", actor_id=f"id{i}", version="v1", group_name=None, group_healthy=False,
        )  # fmt: skip
        out.append(Participant(handle=None, name=f"p-{i}", namespace="ns", meta=meta))
    return out


def _mismatches(src: str, reports: list[dict[str, Any]]) -> tuple[dict[int, list[str]], set[str]]:
    """Per destination rank, the local tensors that differ from the converted reference; and the
    canonical tensors the destination ranks hold."""
    sources = [r for r in reports if r["role"] == "source"]
    reference = to_hf(gather_full([r["exports"] for r in sources]), CONFIG)
    canon = {n: t.contiguous().numpy().view(f"u{t.element_size()}") for n, t in reference.items()}
    _, destination = sides(src, DST)
    held = build_manifest(CONFIG).with_mtp()
    wrong: dict[int, list[str]] = {}
    covered: set[str] = set()
    for i, report in enumerate(r for r in reports if r["role"] == "destination"):
        shard = get_layout("hf").shard(held, destination.spec, destination.coords[i])
        covered |= {p.tensor for p in shard.pieces}
        want = materialize(shard, canon)
        got = {n: t.contiguous().numpy().view(f"u{t.element_size()}") for n, t in report["tensors"].items()}
        assert set(got) == set(want)
        wrong[i] = sorted(n for n in want if not np.array_equal(got[n], want[n]))
    return wrong, covered


@pytest.mark.parametrize("src", ["tp=2", "tp=2,ep=2", "pp=2,layers=2+1"])
def test_megatron_mtp_source_syncs_bit_exact_into_hf_and_scramble_is_caught(
    world: LocalWorld, src: str
) -> None:
    # tp=2: eh_proj split by rows over the two ranks; ep=2: the MTP layer's experts 4-7 are rank 1's
    # local 0-3. pp=2: MTP on stage 1 with its own copy of the embedding (Megatron all-reduces it
    # from stage 0), the sender of the MTP embed_tokens.
    reports = _sync(world, src, scramble=None)
    sources = [r for r in reports if r["role"] == "source"]
    assert [r["layout"] for r in sources] == ["megatron", "megatron"]
    # The real model's parameters are exactly the names the layout expects (the adapter checked
    # shapes and dtypes too); the MTP stage's include GPTModel.mtp's.
    source, _ = sides(src, DST)
    held = build_manifest(CONFIG).with_mtp()
    for report, coord in zip(sources, source.coords, strict=True):
        expected = {t.name for t in get_layout("megatron").shard(held, source.spec, coord).tensors}
        assert {t.name for t in report["tensors"]} == expected
    mtp_names = {t.name for t in sources[-1]["tensors"] if t.name.startswith("mtp.layers.0.")}
    # 4 MTP-only + the MoE block's 13 + 2 per local expert (8 experts over ep; global ids checked
    # by the adapter)
    assert EH_PROJ in mtp_names and len(mtp_names) == 4 + 13 + 2 * 8 // source.spec.ep
    # Discovery, on what the trainer ranks report (names, shapes, dtypes, manifest config): the
    # side holds the MTP part; the same ranks without what MTP adds (mtp.layers.*, and at pp=2
    # stage 1's embedding copy) hold none.
    manifest = build_manifest(sources[0]["model_config"])
    ref = DeploymentRef(
        name="trainer", ray_address="x:1", actor_prefix="p-", layout="megatron",
        parallelism=Parallelism.from_spec(source.spec),
    )  # fmt: skip
    assert check_side(ref, Role.SOURCE, _participants(sources, None), manifest).mtp
    without = [
        {t.name for t in get_layout("megatron").shard(manifest, source.spec, c).tensors}
        for c in source.coords
    ]
    assert not check_side(ref, Role.SOURCE, _participants(sources, without), manifest).mtp
    wrong, covered = _mismatches(src, reports)
    assert wrong == {0: [], 1: []}
    mtp_part = {t.name for t in build_manifest(CONFIG).mtp if t.part == MTP_PART}
    assert len(mtp_part) == 44 and mtp_part <= covered  # every MTP tensor checked, bit for bit
    assert all(r["version"] == "v1" for r in reports if r["role"] == "destination")

    # Negative control: Megatron's eh_proj (every rank's rows) reversed after the export.
    wrong, _ = _mismatches(src, _sync(world, src, scramble=EH_PROJ))
    assert wrong == {0: ["model.layers.3.eh_proj.weight"], 1: ["model.layers.3.eh_proj.weight"]}
