"""Dense layouts: golden shards built independently from the design §4 tables, round trips, errors.

Expected local tensors are written here with explicit numpy slicing and concatenation from the
tables of design §4.1/4.2/4.3, never from pieces, and compared with `materialize()`.
"""

from __future__ import annotations

import numpy as np
import pytest

from sync_runtime.core.layouts import LAYOUTS, get_layout
from sync_runtime.core.layouts.base import RankShard
from sync_runtime.core.layouts.hf import HfLayout
from sync_runtime.core.layouts.materialize import coverage, materialize, reconstruct
from sync_runtime.core.layouts.megatron import MegatronLayout, chunk_ranges
from sync_runtime.core.layouts.vllm import VllmLayout
from sync_runtime.core.manifest import Manifest, TensorMeta
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.errors import LayoutError
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit

SRC, DST = Role.SOURCE, Role.DESTINATION


def model(preset: str, **overrides: object) -> Manifest:
    return build_manifest({**load_model_config(preset), **overrides})


def canon_of(m: Manifest, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Nonzero values, so a zero in a local tensor can only come from padding.
    return {t.name: rng.integers(1, 1 << 16, t.shape, dtype=np.uint16) for t in m.tensors}


def local(layout: str, m: Manifest, spec: ParallelSpec, canon, **coord: int) -> dict[str, np.ndarray]:
    role = SRC if layout.startswith("megatron") else DST
    return materialize(get_layout(layout).shard(m, spec, RankCoord(role=role, **coord)), canon)


# ---------------------------------------------------------------- vllm (design §4.1)

L0 = "model.layers.0."


def vllm_qkv(c, p: str, t: int, r: int, nh: int, nkv: int, d: int, kind: str = "weight") -> np.ndarray:
    q, k, v = (c[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
    qh = nh // t
    if t <= nkv:
        kh = nkv // t
        ks, vs = k[r * kh * d : (r + 1) * kh * d], v[r * kh * d : (r + 1) * kh * d]
    else:
        h = r // (t // nkv)
        ks, vs = k[h * d : (h + 1) * d], v[h * d : (h + 1) * d]
    return np.concatenate([q[r * qh * d : (r + 1) * qh * d], ks, vs])


@pytest.mark.parametrize("t", [1, 2, 4], ids=["t<nkv", "t==nkv", "t>nkv-replicated"])
def test_vllm_qkv(t: int) -> None:
    m = model("tiny-llama")  # nh=8, nkv=2, d=16
    c = canon_of(m)
    for r in range(t):
        got = local("vllm", m, ParallelSpec(tp=t), c, tp_rank=r)
        want = vllm_qkv(c, L0, t, r, 8, 2, 16)
        assert got[L0 + "self_attn.qkv_proj.weight"].shape == ((8 // t + 2 * max(1, 2 // t)) * 16, 128)
        np.testing.assert_array_equal(got[L0 + "self_attn.qkv_proj.weight"], want)
        assert L0 + "self_attn.q_proj.weight" not in got


def test_vllm_kv_replication_pairs_share_head() -> None:
    m = model("tiny-llama")
    c = canon_of(m)
    spec = ParallelSpec(tp=4)  # nkv=2: ranks 0,1 hold kv head 0; ranks 2,3 hold head 1
    qkv = [local("vllm", m, spec, c, tp_rank=r)[L0 + "self_attn.qkv_proj.weight"] for r in range(4)]
    k = c[L0 + "self_attn.k_proj.weight"]
    np.testing.assert_array_equal(qkv[0][32:48], k[0:16])
    np.testing.assert_array_equal(qkv[1][32:48], k[0:16])
    np.testing.assert_array_equal(qkv[3][32:48], k[16:32])


def test_vllm_qkv_bias() -> None:
    m = model("tiny-qwen2")  # nh=4, nkv=2, d=16
    c = canon_of(m)
    for r in range(2):
        got = local("vllm", m, ParallelSpec(tp=2), c, tp_rank=r)
        np.testing.assert_array_equal(
            got[L0 + "self_attn.qkv_proj.bias"], vllm_qkv(c, L0, 2, r, 4, 2, 16, "bias")
        )


def test_vllm_gate_up_o_down() -> None:
    m = model("tiny-llama")  # I=256
    c = canon_of(m)
    for r in range(4):
        got = local("vllm", m, ParallelSpec(tp=4), c, tp_rank=r)
        gate, up = c[L0 + "mlp.gate_proj.weight"], c[L0 + "mlp.up_proj.weight"]
        rows = slice(r * 64, (r + 1) * 64)
        np.testing.assert_array_equal(
            got[L0 + "mlp.gate_up_proj.weight"], np.concatenate([gate[rows], up[rows]])
        )
        np.testing.assert_array_equal(
            got[L0 + "mlp.down_proj.weight"], c[L0 + "mlp.down_proj.weight"][:, rows]
        )
        np.testing.assert_array_equal(
            got[L0 + "self_attn.o_proj.weight"], c[L0 + "self_attn.o_proj.weight"][:, r * 32 : (r + 1) * 32]
        )
        np.testing.assert_array_equal(got[L0 + "input_layernorm.weight"], c[L0 + "input_layernorm.weight"])
        np.testing.assert_array_equal(got["model.norm.weight"], c["model.norm.weight"])


def test_vllm_vocab_padding_rows_zero() -> None:
    m = model("tiny-llama")  # V=1000 -> Vp=1024, 256 rows per rank at tp=4
    c = canon_of(m)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        last = local("vllm", m, ParallelSpec(tp=4), c, tp_rank=3)[name]
        assert last.shape == (256, 128)
        np.testing.assert_array_equal(last[:232], c[name][768:1000])
        assert not last[232:].any()
        first = local("vllm", m, ParallelSpec(tp=4), c, tp_rank=1)[name]
        np.testing.assert_array_equal(first, c[name][256:512])


def test_vllm_tied_lm_head() -> None:
    m = model("tiny-llama-tied")  # V=777 -> Vp=832, L=3
    c = canon_of(m)
    one = local("vllm", m, ParallelSpec(tp=2), c, tp_rank=1)
    assert "lm_head.weight" not in one and "model.embed_tokens.weight" in one
    spec = ParallelSpec(tp=2, pp=2)
    # vLLM's last stage holds an embedding of its own, which lm_head shares (reported under the
    # embedding's name: tests/engines/test_vllm_pp.py); the first stage holds the same rows.
    last = local("vllm", m, spec, c, tp_rank=1, pp_rank=1)
    assert "lm_head.weight" not in last
    head = last["model.embed_tokens.weight"]
    assert head.shape == (416, 64)
    np.testing.assert_array_equal(head[: 777 - 416], c["model.embed_tokens.weight"][416:777])
    assert not head[777 - 416 :].any()
    first = local("vllm", m, spec, c, tp_rank=1, pp_rank=0)
    assert "lm_head.weight" not in first
    np.testing.assert_array_equal(first["model.embed_tokens.weight"], head)


def test_vllm_pp_global_layer_names_and_uneven_split() -> None:
    m = model("tiny-llama-tied")  # L=3: default split 2+1
    names = [
        t.name for t in VllmLayout().shard(m, ParallelSpec(pp=2), RankCoord(role=DST, pp_rank=1)).tensors
    ]
    assert any(n.startswith("model.layers.2.") for n in names)
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names)
    spec = ParallelSpec(pp=2, layer_counts=(1, 2))
    names = [t.name for t in VllmLayout().shard(m, spec, RankCoord(role=DST, pp_rank=1)).tensors]
    assert any(n.startswith("model.layers.1.") for n in names)
    assert not any(n.startswith("model.layers.0.") for n in names)


# ---------------------------------------------------------------- megatron (design §4.2)

M0 = "decoder.layers.0."


def megatron_qkv(c, p: str, t: int, r: int, nh: int, nkv: int, d: int, kind: str = "weight") -> np.ndarray:
    q, k, v = (c[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
    per = nh // nkv
    parts = []
    for g in range(r * nkv // t, (r + 1) * nkv // t):
        parts += [q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    return np.concatenate(parts)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_megatron_linear_qkv_groups(t: int) -> None:
    m = model("tiny-qwen3")  # nh=8, nkv=4, d=32
    c = canon_of(m)
    for r in range(t):
        got = local("megatron", m, ParallelSpec(tp=t), c, tp_rank=r)
        np.testing.assert_array_equal(
            got[M0 + "self_attention.linear_qkv.weight"], megatron_qkv(c, L0, t, r, 8, 4, 32)
        )
        np.testing.assert_array_equal(
            got[M0 + "self_attention.q_layernorm.weight"], c[L0 + "self_attn.q_norm.weight"]
        )
        np.testing.assert_array_equal(
            got[M0 + "self_attention.k_layernorm.weight"], c[L0 + "self_attn.k_norm.weight"]
        )
        # Local spec (what Megatron-Core builds without TE): the norm is a module of its own.
        np.testing.assert_array_equal(got[M0 + "input_layernorm.weight"], c[L0 + "input_layernorm.weight"])
        te = local("megatron-te", m, ParallelSpec(tp=t), c, tp_rank=r)  # TE fuses it into linear_qkv
        np.testing.assert_array_equal(
            te[M0 + "self_attention.linear_qkv.layer_norm_weight"], c[L0 + "input_layernorm.weight"]
        )
        assert M0 + "input_layernorm.weight" not in te


def test_megatron_qkv_bias_grouped() -> None:
    m = model("tiny-qwen2")  # nh=4, nkv=2, d=16
    c = canon_of(m)
    got = local("megatron", m, ParallelSpec(tp=2), c, tp_rank=1)
    np.testing.assert_array_equal(
        got[M0 + "self_attention.linear_qkv.bias"], megatron_qkv(c, L0, 2, 1, 4, 2, 16, "bias")
    )


def test_megatron_mlp_and_proj() -> None:
    m = model("tiny-llama")
    c = canon_of(m)
    for r in range(2):
        got = local("megatron", m, ParallelSpec(tp=2), c, tp_rank=r)
        rows = slice(r * 128, (r + 1) * 128)
        fc1 = np.concatenate([c[L0 + "mlp.gate_proj.weight"][rows], c[L0 + "mlp.up_proj.weight"][rows]])
        np.testing.assert_array_equal(got[M0 + "mlp.linear_fc1.weight"], fc1)
        np.testing.assert_array_equal(
            got[M0 + "mlp.linear_fc2.weight"], c[L0 + "mlp.down_proj.weight"][:, rows]
        )
        # Local spec: pre_mlp_layernorm in dense layers too; TE fuses it into linear_fc1.
        np.testing.assert_array_equal(
            got[M0 + "pre_mlp_layernorm.weight"], c[L0 + "post_attention_layernorm.weight"]
        )
        te = local("megatron-te", m, ParallelSpec(tp=2), c, tp_rank=r)
        np.testing.assert_array_equal(
            te[M0 + "mlp.linear_fc1.layer_norm_weight"], c[L0 + "post_attention_layernorm.weight"]
        )
        np.testing.assert_array_equal(te[M0 + "mlp.linear_fc1.weight"], fc1)
        np.testing.assert_array_equal(
            got[M0 + "self_attention.linear_proj.weight"],
            c[L0 + "self_attn.o_proj.weight"][:, r * 64 : (r + 1) * 64],
        )
        np.testing.assert_array_equal(got["decoder.final_layernorm.weight"], c["model.norm.weight"])


def test_megatron_vocab_padding_multiple_of_128_t() -> None:
    m = model("tiny-llama")  # V=1000; t=2 -> Vp=1024 (multiple of 256), 512 rows per rank
    c = canon_of(m)
    got = local("megatron", m, ParallelSpec(tp=2), c, tp_rank=1)
    for name, canon in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ):
        assert got[name].shape == (512, 128)
        np.testing.assert_array_equal(got[name][:488], c[canon][512:1000])
        assert not got[name][488:].any()
    m3 = model("tiny-qwen3", vocab_size=1200)  # t=4 -> multiple of 512 -> Vp=1536, 384 rows per rank
    got = local("megatron", m3, ParallelSpec(tp=4), canon_of(m3), tp_rank=3)
    assert got["embedding.word_embeddings.weight"].shape == (384, 128)
    assert not got["embedding.word_embeddings.weight"][1200 - 1152 :].any()


def test_megatron_tied_output_layer_copy() -> None:
    m = model("tiny-llama-tied")  # V=777, t=2 -> Vp=1024
    c = canon_of(m)
    one = local("megatron", m, ParallelSpec(tp=2), c, tp_rank=0)
    assert "output_layer.weight" not in one
    spec = ParallelSpec(tp=2, pp=3)
    last = local("megatron", m, spec, c, tp_rank=1, pp_rank=2)
    assert "embedding.word_embeddings.weight" not in last
    np.testing.assert_array_equal(
        last["output_layer.weight"][: 777 - 512], c["model.embed_tokens.weight"][512:]
    )
    first = local("megatron", m, spec, c, tp_rank=1, pp_rank=0)
    np.testing.assert_array_equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])
    shard = MegatronLayout().shard(m, spec, RankCoord(role=SRC, pp_rank=2))
    assert {p.tensor for p in shard.pieces if p.local_name == "output_layer.weight"} == {
        "model.embed_tokens.weight"
    }


def test_megatron_vpp_chunks_names_and_blocks() -> None:
    m = model("tiny-llama")  # L=4, p=2, v=2: blocks of 1 layer; stage 0 holds blocks 0 and 2
    c = canon_of(m)
    spec = ParallelSpec(pp=2, vpp=2)
    s0 = local("megatron", m, spec, c, pp_rank=0)
    s1 = local("megatron", m, spec, c, pp_rank=1)
    assert "chunk0.embedding.word_embeddings.weight" in s0 and "chunk1.output_layer.weight" in s1
    assert "chunk1.decoder.final_layernorm.weight" in s1 and not any("final_layernorm" in n for n in s0)
    for rank, chunk, layer in ((s0, 0, 0), (s0, 1, 2), (s1, 0, 1), (s1, 1, 3)):
        np.testing.assert_array_equal(
            rank[f"chunk{chunk}.decoder.layers.0.self_attention.linear_proj.weight"],
            c[f"model.layers.{layer}.self_attn.o_proj.weight"],
        )
    assert not any(n.startswith("decoder.") for n in s0)


def test_megatron_vpp_with_layer_counts() -> None:
    m = model("tiny-llama", num_hidden_layers=6)
    spec = ParallelSpec(pp=2, vpp=2, layer_counts=(4, 2))  # stage 0 blocks of 2, stage 1 blocks of 1
    assert chunk_ranges(6, spec) == [[range(0, 2), range(3, 5)], [range(2, 3), range(5, 6)]]
    c = canon_of(m)
    s0 = local("megatron", m, spec, c, pp_rank=0)
    np.testing.assert_array_equal(
        s0["chunk1.decoder.layers.1.mlp.linear_fc2.weight"], c["model.layers.4.mlp.down_proj.weight"]
    )
    with pytest.raises(LayoutError, match=r"megatron: layer_counts: .* divisible by vpp=2"):
        MegatronLayout().validate(m, ParallelSpec(pp=2, vpp=2, layer_counts=(3, 3)))
    with pytest.raises(LayoutError, match=r"megatron: vpp: L=6 layers not divisible by pp\*vpp=4"):
        MegatronLayout().validate(m, ParallelSpec(pp=2, vpp=2))


def test_megatron_uneven_pp_local_indices() -> None:
    m = model("tiny-llama-tied")  # L=3
    c = canon_of(m)
    s1 = local("megatron", m, ParallelSpec(pp=2, layer_counts=(1, 2)), c, pp_rank=1)
    np.testing.assert_array_equal(s1[M0 + "mlp.linear_fc2.weight"], c["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(
        s1["decoder.layers.1.mlp.linear_fc2.weight"], c["model.layers.2.mlp.down_proj.weight"]
    )
    # Megatron-Core refuses L % pp != 0 without explicit stage sizes (it never gives the first
    # stages an extra layer): so does the layout, whichever naming.
    for name in ("megatron", "megatron-te"):
        with pytest.raises(LayoutError, match=r"pp: L=3 layers not divisible by pp=2 .*layer_counts"):
            get_layout(name).validate(m, ParallelSpec(pp=2))


def test_megatron_dp_replicas_identical() -> None:
    m = model("tiny-llama")
    spec = ParallelSpec(tp=2, dp=2)
    a = MegatronLayout().shard(m, spec, RankCoord(role=SRC, tp_rank=1, dp_rank=0))
    b = MegatronLayout().shard(m, spec, RankCoord(role=SRC, tp_rank=1, dp_rank=1))
    assert a.pieces == b.pieces and a.tensors == b.tensors


# ---------------------------------------------------------------- hf (design §4.3)


def test_hf_full_and_tp_sharded() -> None:
    m = model("tiny-llama")
    c = canon_of(m)
    full = local("hf", m, ParallelSpec(), c)
    assert set(full) == set(c)
    for name in c:
        np.testing.assert_array_equal(full[name], c[name])
    got = local("hf", m, ParallelSpec(tp=4), c, tp_rank=3)
    np.testing.assert_array_equal(
        got[L0 + "self_attn.q_proj.weight"], c[L0 + "self_attn.q_proj.weight"][96:128]
    )
    np.testing.assert_array_equal(
        got[L0 + "self_attn.k_proj.weight"], c[L0 + "self_attn.k_proj.weight"][16:32]
    )
    np.testing.assert_array_equal(
        got[L0 + "self_attn.o_proj.weight"], c[L0 + "self_attn.o_proj.weight"][:, 96:128]
    )
    np.testing.assert_array_equal(got[L0 + "mlp.up_proj.weight"], c[L0 + "mlp.up_proj.weight"][192:256])
    np.testing.assert_array_equal(
        got[L0 + "mlp.down_proj.weight"], c[L0 + "mlp.down_proj.weight"][:, 192:256]
    )
    assert got["lm_head.weight"].shape == (256, 128) and not got["lm_head.weight"][232:].any()


# ---------------------------------------------------------------- round trips


def all_shards(layout: str, m: Manifest, spec: ParallelSpec) -> list[RankShard]:
    lay = get_layout(layout)
    lay.validate(m, spec)
    # a destination's dp is vLLM's wide EP only (topology.check_destination): hf at dp > 1 is a source
    role = SRC if layout.startswith("megatron") or (layout == "hf" and spec.dp > 1) else DST
    return [lay.shard(m, spec, c) for c in enumerate_ranks(spec, role)]


def assert_round_trip(layout: str, m: Manifest, spec: ParallelSpec) -> None:
    c = canon_of(m, seed=7)
    shards = all_shards(layout, m, spec)
    for shard in shards:  # every piece is a same-size, in-bounds region of its local tensor
        shapes = {t.name: t.shape for t in shard.tensors}
        assert len(shapes) == len(shard.tensors), "duplicate local tensor names"
        for p in shard.pieces:
            canon_ext = [b - a for a, b in p.canon_box]
            local_ext = [b - a for a, b in p.local_box]
            assert local_ext[len(local_ext) - len(canon_ext) :] == canon_ext and all(
                e == 1 for e in local_ext[: len(local_ext) - len(canon_ext)]
            )
            assert all(0 <= a < b <= s for (a, b), s in zip(p.local_box, shapes[p.local_name], strict=True))
    locals_ = [materialize(s, c) for s in shards]
    rebuilt = reconstruct(shards, locals_, m)
    for name, value in c.items():
        np.testing.assert_array_equal(rebuilt[name], value, err_msg=f"{layout} {spec.describe()} {name}")
    replicas = sorted({s.coord.replica for s in shards})
    for k in replicas:  # every canonical element held by at least one rank of every replica
        counts = coverage([s for s in shards if s.coord.replica == k], m)
        uncovered = [n for n, a in counts.items() if (a == 0).any()]
        assert not uncovered, f"{layout} {spec.describe()} replica {k}: uncovered {uncovered[:3]}"


DENSE = ["tiny-llama", "tiny-llama-tied", "tiny-qwen2", "tiny-qwen3"]
GRID = {
    "vllm": ["tp=1", "tp=2", "tp=4", "tp=2,pp=2", "tp=4,pp=2,replicas=2", "pp=2,layers=1+1"],
    "megatron": ["tp=1", "tp=2", "tp=2,dp=2", "tp=2,pp=2", "pp=2,vpp=2", "tp=2,pp=2,layers=1+1"],
    "megatron-te": ["tp=2", "tp=2,pp=2,layers=1+1"],
    "hf": ["tp=1", "tp=1,dp=2", "tp=2", "tp=4,pp=2"],
}


@pytest.mark.parametrize("preset", DENSE)
@pytest.mark.parametrize(("layout", "spec"), [(lay, s) for lay, specs in GRID.items() for s in specs])
def test_round_trip_dense(layout: str, spec: str, preset: str) -> None:
    m = model(preset)
    parsed = ParallelSpec.parse(spec)
    try:
        get_layout(layout).validate(m, parsed)
    except LayoutError as e:
        # Only the documented constraints may refuse a grid point; the refusal is the result.
        assert any(k in str(e) for k in ("nkv=", "vpp", "layers", "layer_counts")), str(e)
        return
    assert_round_trip(layout, m, parsed)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("layout", "overrides", "spec", "pattern"),
    [
        (
            "vllm",
            {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 8},
            "tp=8",
            r"vllm: model\.layers\.0\.self_attn\.q_proj\.weight: nh=12 not divisible by tp=8",
        ),
        (
            "vllm",
            {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 8},
            "tp=3",
            r"vllm: model\.embed_tokens\.weight: padded vocab Vp=1024 not divisible by tp=3",
        ),
        (
            "vllm",
            {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
            "tp=2",
            r"vllm: model\.layers\.0\.self_attn\.k_proj\.weight: nkv=3 and tp=2: one must divide the other",
        ),
        (
            "megatron",
            {},
            "tp=4",
            r"megatron: model\.layers\.0\.self_attn\.k_proj\.weight: nkv=2 not divisible by tp=4",
        ),
        (
            "megatron",
            {"intermediate_size": 251},
            "tp=2",
            r"megatron: mlp\.gate_proj\.weight: I=251 not divisible by tp=2",
        ),
        (
            "hf",
            {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 8},
            "tp=8",
            r"hf: model\.layers\.0\.self_attn\.q_proj\.weight: nh=12 not divisible by tp=8",
        ),
        ("vllm", {}, "pp=5", r"vllm: pp: pp=5 has more stages than the model's 4 layers"),
        ("megatron", {}, "pp=5", r"megatron: pp: pp=5 has more stages than the model's 4 layers"),
        ("hf", {}, "pp=5", r"hf: pp: pp=5 has more stages"),
        ("vllm", {}, "tp=2,vpp=2", r"vllm: vpp: vpp=2"),
    ],
)
def test_layout_errors(layout: str, overrides: dict, spec: str, pattern: str) -> None:
    m = model("tiny-llama", **overrides)
    with pytest.raises(LayoutError, match=pattern):
        get_layout(layout).validate(m, ParallelSpec.parse(spec))
    with pytest.raises(LayoutError, match=pattern):  # shard() refuses the same specs
        get_layout(layout).shard(m, ParallelSpec.parse(spec), RankCoord(role=DST))


def test_vllm_intermediate_not_divisible() -> None:
    m = model("tiny-llama", intermediate_size=250)
    with pytest.raises(LayoutError, match=r"vllm: mlp\.gate_proj\.weight: I=250 not divisible by tp=4"):
        VllmLayout().validate(m, ParallelSpec(tp=4))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_uncovered_tensor_is_an_error(layout: str) -> None:
    m = model("tiny-llama")
    extra = TensorMeta("model.layers.1.self_attn.rotary_emb.inv_freq", (8,))
    bad = Manifest(m.family, (*m.tensors, extra), m.config)
    with pytest.raises(
        LayoutError, match=rf"{layout}: model\.layers\.1\.self_attn\.rotary_emb\.inv_freq: no rule"
    ):
        get_layout(layout).validate(bad, ParallelSpec())
    odd = Manifest(m.family, (*m.tensors, TensorMeta("model.extra.weight", (8,))), m.config)
    with pytest.raises(LayoutError, match=r"model\.extra\.weight: not a tensor any layout knows"):
        get_layout(layout).validate(odd, ParallelSpec())


def test_unknown_layout() -> None:
    with pytest.raises(
        LayoutError, match=r"unknown layout 'fsdp' \(known: hf, megatron, megatron-te, vllm\)"
    ):
        get_layout("fsdp")


def test_registry_types() -> None:
    assert isinstance(LAYOUTS["hf"], HfLayout) and isinstance(LAYOUTS["vllm"], VllmLayout)
    assert all(lay.name == name for name, lay in LAYOUTS.items())
