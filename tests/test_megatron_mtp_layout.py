"""The `megatron` layout's MTP placement (layouts/megatron_mtp.py): Megatron-Core 0.19.2's
GPTModel.mtp names and TP shards, the MTP layer's embed_tokens / shared_head.head as pieces of the
main embedding and output layer, plans from a megatron source into an `hf` destination that
serves MTP (every MTP element written exactly once), discovery of a source built with or without
MTP layers, and the converter's names for them. Pure (no Megatron-Core import)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.base import RankShard
from sync_runtime.core.layouts.materialize import bits_dtype, materialize
from sync_runtime.core.manifest import MTP_PART, Manifest
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.engines.megatron_convert import to_hf
from sync_runtime.errors import LayoutError
from sync_runtime.planner import PlannerConfig, plan_sync
from sync_runtime.planner.simulate import random_canonical, simulate
from sync_runtime.runtime.discovery import Participant, check_side
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.schema.crd import DeploymentRef, Parallelism
from sync_runtime.testing.megatron_mtp import sides

pytestmark = pytest.mark.unit

CONFIG = load_model_config("tiny-deepseek-v3")  # L=3 (layer 0 dense, 1-2 MoE), MTP layer 3, H=128, V=960
PLAIN = build_manifest(CONFIG)
HELD = PLAIN.with_mtp()
MTP = "mtp.layers.0."
BLOCK = MTP + "mtp_model_layer."
SHARED = {"model.layers.3.embed_tokens.weight": "model.embed_tokens.weight"}
"""An MTP-layer tensor -> the main model tensor whose bytes Megatron's MTP layer uses."""
SHARED_HEAD = {"model.layers.3.shared_head.head.weight": "lm_head.weight"}


def _shard(manifest: Manifest, spec: str, **coord: int) -> RankShard:
    return get_layout("megatron").shard(
        manifest, ParallelSpec.parse(spec), RankCoord(role=Role.SOURCE, **coord)
    )


def _shapes(shard: RankShard) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in shard.tensors}


def _canon(seed: int = 0, shared: bool = True) -> dict[str, np.ndarray]:
    """Random canonical bits; `shared`: the MTP layer's embed_tokens / shared_head.head equal the
    main embedding / lm_head, as in a Megatron model (one embedding, one output layer)."""
    canon = random_canonical(HELD, seed)
    if shared:
        for mtp, main in {**SHARED, **SHARED_HEAD}.items():
            canon[mtp] = canon[main].copy()
    return canon


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_names_and_tp_shards(tp: int) -> None:
    canon = _canon()
    for r in range(tp):
        shard = _shard(HELD, f"tp={tp}", tp_rank=r)
        shapes = _shapes(shard)
        local = materialize(shard, canon)
        # MTP-only tensors: norms whole, eh_proj a ColumnParallelLinear (rows r-th of t).
        assert shapes[MTP + "enorm.weight"] == shapes[MTP + "hnorm.weight"] == (128,)
        assert shapes[MTP + "final_layernorm.weight"] == (128,)
        assert shapes[MTP + "eh_proj.weight"] == (128 // tp, 256)
        rows = slice(r * 128 // tp, (r + 1) * 128 // tp)
        assert np.array_equal(local[MTP + "eh_proj.weight"], canon["model.layers.3.eh_proj.weight"][rows])
        assert np.array_equal(
            local[MTP + "final_layernorm.weight"], canon["model.layers.3.shared_head.norm.weight"]
        )
        # The block under mtp_model_layer., named and cut as a decoder layer (MLA, MoE, 8 experts).
        assert shapes[BLOCK + "self_attention.linear_q_up_proj.weight"] == (96 // tp, 48)
        assert shapes[BLOCK + "self_attention.linear_proj.weight"] == (128, 64 // tp)
        assert shapes[BLOCK + "mlp.experts.local_experts.7.linear_fc1.weight"] == (64, 128)  # etp=1
        assert shapes[BLOCK + "mlp.router.expert_bias"] == (8,)
        assert shapes == {**_shapes(_shard(PLAIN, f"tp={tp}", tp_rank=r)), **_mtp_only(shapes)}
        # No tensor of its own for the shared vocab rows: pieces of the main ones, same rows.
        assert not any((n.startswith(MTP) and "embed" in n) or n.endswith("head.weight") for n in shapes)
        vocab = 1024 // tp  # V=960 padded to a multiple of 128*tp
        assert shapes["embedding.word_embeddings.weight"] == shapes["output_layer.weight"] == (vocab, 128)
        held = {(p.tensor, p.local_name, p.canon_box) for p in shard.pieces}
        for mtp, main, local in [
            (
                "model.layers.3.embed_tokens.weight",
                "model.embed_tokens.weight",
                "embedding.word_embeddings.weight",
            ),
            ("model.layers.3.shared_head.head.weight", "lm_head.weight", "output_layer.weight"),
        ]:
            top = min((r + 1) * vocab, 960)
            assert (mtp, local, ((r * vocab, top), (0, 128))) in held
            assert (main, local, ((r * vocab, top), (0, 128))) in held


def _mtp_only(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {n: s for n, s in shapes.items() if n.startswith(MTP)}


def test_mtp_lives_on_the_last_chunk_with_its_own_embedding_copy() -> None:
    # pp=3, vpp=1: only stage 2 holds MTP; it also holds a copy of the embedding (Megatron's
    # "duplicated embedding weights in mtp process stage"), another sender of model.embed_tokens.
    spec = "tp=1,pp=3"
    assert not any(n.startswith("mtp.") for n in _shapes(_shard(HELD, spec, pp_rank=1)))
    last = _shard(HELD, spec, pp_rank=2)
    on_embedding = {p.tensor for p in last.pieces if p.local_name == "embedding.word_embeddings.weight"}
    assert on_embedding == {"model.embed_tokens.weight", "model.layers.3.embed_tokens.weight"}
    assert "embedding.word_embeddings.weight" not in _shapes(
        _shard(PLAIN, spec, pp_rank=2)
    )  # no MTP: no copy
    # vpp=3 at pp=1: the last chunk (chunk2.) holds the MTP block and its embedding copy.
    chunked = _shapes(_shard(HELD, "pp=1,vpp=3"))
    assert (
        "chunk2.mtp.layers.0.eh_proj.weight" in chunked
        and "chunk2.embedding.word_embeddings.weight" in chunked
    )
    assert not any(n.startswith(("chunk0.mtp", "chunk1.mtp")) for n in chunked)


def test_tied_model_shares_the_embedding_as_mtp_head() -> None:
    tied = build_manifest({**CONFIG, "tie_word_embeddings": True}).with_mtp()
    one = _shard(tied, "tp=1")  # pp=1: no output_layer; the head is the embedding
    head = [p.local_name for p in one.pieces if p.tensor == "model.layers.3.shared_head.head.weight"]
    assert head == ["embedding.word_embeddings.weight"]
    # pp=3: the MTP stage projects with its embedding copy; its tied output_layer.weight is unused
    # by Megatron (held, but no sender of anything), unlike the same stage without MTP.
    last = _shard(tied, "pp=3", pp_rank=2)
    head = [p.local_name for p in last.pieces if p.tensor == "model.layers.3.shared_head.head.weight"]
    assert head == ["embedding.word_embeddings.weight"]
    assert "output_layer.weight" in _shapes(last)
    assert not [p for p in last.pieces if p.local_name == "output_layer.weight"]
    plain = _shard(build_manifest({**CONFIG, "tie_word_embeddings": True}), "pp=3", pp_rank=2)
    assert {p.tensor for p in plain.pieces if p.local_name == "output_layer.weight"} == {
        "model.embed_tokens.weight"
    }


def test_a_megatron_destination_of_the_mtp_part_is_refused_in_one_line() -> None:
    coord = RankCoord(role=Role.DESTINATION)
    with pytest.raises(LayoutError, match=r"model\.layers\.3\.embed_tokens\.weight \(MTP\): .*cannot hold"):
        get_layout("megatron").shard(HELD, ParallelSpec(tp=1), coord)
    assert get_layout("megatron").shard(PLAIN, ParallelSpec(tp=1), coord).tensors  # without MTP: as before


Result = tuple[dict[int, dict[str, np.ndarray]], dict[int, dict[str, np.ndarray]], dict[int, RankShard]]


def _simulate(src: str, dst: str, canon: dict[str, np.ndarray], scramble: str | None = None) -> Result:
    """Run the plan on the sources' `materialize(shard, canon)`; `scramble`: a source local
    tensor whose bits are inverted on every rank holding it. (destination arrays, write counts, shards)."""
    source, destination = sides(src, dst)
    plan = plan_sync(PLAIN, source, [destination], PlannerConfig(bucket_bytes=32 * 1024))
    shards = {}
    for rank, coord in enumerate((*source.coords, *destination.coords)):
        layout, spec = ("megatron", source.spec) if coord.role is Role.SOURCE else ("hf", destination.spec)
        shards[rank] = get_layout(layout).shard(HELD, spec, coord)
    src_locals = {r: materialize(s, canon) for r, s in shards.items() if s.coord.role is Role.SOURCE}
    for local in src_locals.values():
        if scramble in local:
            local[scramble] = ~local[scramble]
    dst_shapes = {
        r: {t.name: (t.shape, bits_dtype(t.dtype)) for t in s.tensors}
        for r, s in shards.items()
        if s.coord.role is Role.DESTINATION
    }
    got, counts = simulate(plan, src_locals, dst_shapes)
    return got, counts, shards


@pytest.mark.parametrize("src", ["tp=2", "tp=2,pp=3", "tp=2,ep=2,dp=2", "pp=1,vpp=3"])
def test_plan_from_megatron_covers_every_mtp_element_of_an_hf_destination_once(src: str) -> None:
    canon = _canon(seed=3)
    got, counts, shards = _simulate(src, "tp=2", canon)
    mtp_names = {t.name for t in HELD.tensors if t.part == MTP_PART}
    seen: set[str] = set()
    for rank, local in got.items():
        shard = shards[rank]
        want = materialize(shard, canon)
        for name, array in local.items():
            assert np.array_equal(array, want[name]), (rank, name)
        covered = {t.name: np.zeros(t.shape, dtype=np.int32) for t in shard.tensors}
        for p in shard.pieces:
            covered[p.local_name][tuple(slice(lo, hi) for lo, hi in p.local_box)] += 1
            seen.add(p.tensor)
        for name, count in counts[rank].items():  # every covered element once, nothing else
            assert np.array_equal(count, covered[name]) and count.max() == 1, (rank, name)
    assert mtp_names <= seen and len(mtp_names) == 44  # the hf destination holds every MTP tensor


def _wrong(got: dict[int, dict[str, np.ndarray]], shards: dict[int, RankShard], canon: dict) -> set[str]:
    """Destination local tensors that differ from `materialize(shard, canon)`."""
    wrong = set()
    for rank, local in got.items():
        want = materialize(shards[rank], canon)
        wrong |= {n for n, a in local.items() if not np.array_equal(a, want[n])}
    return wrong


def test_scrambled_source_eh_proj_and_unshared_vocab_rows_show() -> None:
    canon = _canon(seed=4)
    # Negative control: one MTP source tensor scrambled (both TP shards) -> exactly its HF tensor differs.
    got, _, shards = _simulate("tp=2", "tp=2", canon, scramble=MTP + "eh_proj.weight")
    assert _wrong(got, shards, canon) == {"model.layers.3.eh_proj.weight"}
    # A checkpoint whose MTP embed_tokens / shared_head.head differ from the main tensors is not
    # what a Megatron model holds: a megatron source sends the main tensors' bytes for them.
    got, _, shards = _simulate("tp=2", "tp=2", canon)
    assert _wrong(got, shards, canon) == set()
    unshared = _canon(seed=4, shared=False)
    assert _wrong(got, shards, unshared) == {*SHARED, *SHARED_HEAD}


def _participants(spec: ParallelSpec, held: Manifest) -> list[Participant]:
    """Source ranks reporting the shard of `held` (with_mtp(): a trainer built with MTP layers)."""
    out = []
    for i, c in enumerate(enumerate_ranks(spec, Role.SOURCE)):
        tensors = get_layout("megatron").shard(held, spec, c).tensors
        meta = ParticipantMeta(
            role=Role.SOURCE, coord=c, layout="megatron", tensors=tensors, node_ip="10.0.0.1", device="cpu",
            pid=100 + i, actor_name=f"p-{i}", actor_id=f"id{i}", version="v0", group_name=None,
            group_healthy=False,
        )  # fmt: skip
        out.append(Participant(handle=None, name=f"p-{i}", namespace="ns", meta=meta))
    return out


@pytest.mark.parametrize("spec_text", ["tp=2", "tp=1,pp=3"])
def test_discovery_finds_mtp_only_where_the_trainer_built_it(spec_text: str) -> None:
    # DeepSeek-V3's config always has num_nextn_predict_layers=1: a trainer built without MTP
    # layers reports the main embedding and output layer (which MTP pieces also use) but no
    # mtp.layers.*: its side holds no MTP part. One built with them does.
    spec = ParallelSpec.parse(spec_text)
    ref = DeploymentRef(
        name="trainer", ray_address="x:1", actor_prefix="p-", layout="megatron",
        parallelism=Parallelism(tp=spec.tp, pp=spec.pp),
    )  # fmt: skip
    assert not check_side(ref, Role.SOURCE, _participants(spec, PLAIN), PLAIN).mtp
    assert check_side(ref, Role.SOURCE, _participants(spec, HELD), PLAIN).mtp


def test_converter_names_mtp_layers_and_shares_the_vocab_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    full = {
        "embedding.word_embeddings.weight": torch.randn(1024, 128, generator=g),
        "output_layer.weight": torch.randn(1024, 128, generator=g),
        "mtp.layers.0.eh_proj.weight": torch.randn(128, 256, generator=g),
        "mtp.layers.0.final_layernorm.weight": torch.randn(128, generator=g),
        "mtp.layers.0.mtp_model_layer.self_attention.linear_kv_up_proj.weight": torch.randn(
            128, 32, generator=g
        ),
    }
    hf = to_hf(full, CONFIG)
    assert torch.equal(hf["model.layers.3.eh_proj.weight"], full["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(
        hf["model.layers.3.shared_head.norm.weight"], full["mtp.layers.0.final_layernorm.weight"]
    )
    assert torch.equal(hf["model.layers.3.self_attn.kv_b_proj.weight"], full[next(iter(reversed(full)))])
    assert torch.equal(
        hf["model.layers.3.embed_tokens.weight"], full["embedding.word_embeddings.weight"][:960]
    )
    assert torch.equal(hf["model.layers.3.shared_head.head.weight"], full["output_layer.weight"][:960])
    assert "model.layers.3.embed_tokens.weight" not in to_hf({k: full[k] for k in list(full)[:2]}, CONFIG)
