"""gpt-oss under the `megatron` layout: the reorientation table and the layout's expert boxes.

The Megatron-Core side is written here from Megatron's own definition (SequentialMLP's per-expert
`linear_fc1` = [gate rows; up rows] of the rank's Im range, `linear_fc2` = down's columns, biases
alike), sliced out of the checkpoint's fused tensors with explicit numpy indexing, never from
pieces or from the table; the layout's local tensors (materialize) must equal the table's
reorientation of those live tensors, on every rank of a grid; gpt-oss-20b plans from a megatron
source at the lower bound. The real-rank proof is tests/engines/test_megatron_families.py.
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sync_runtime.cli import main as cli
from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.layouts.megatron_gpt_oss import (
    ETP_REFUSAL,
    REORIENTED,
    TE_REFUSAL,
    Reorient,
    sent_shape,
)
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.engines.megatron import MegatronSourceParticipant
from sync_runtime.engines.megatron_names import LiveTensor
from sync_runtime.engines.megatron_reorient import ReorientedTensors, is_view, reorientation, to_live, to_sent
from sync_runtime.errors import LayoutError, SourceChanged
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import WeightSyncParticipant
from sync_runtime.transfer import RankResult
from tests.test_layouts import assert_round_trip, canon_of

pytestmark = pytest.mark.unit

FC1W, FC1B, FC2W, FC2B = "linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"


def _live_shape(suffix: str, n: int, hidden: int) -> tuple[int, ...]:
    """Megatron-Core's shape of a local expert's parameter (n = the rank's Im rows)."""
    return {FC1W: (2 * n, hidden), FC1B: (2 * n,), FC2W: (hidden, n), FC2B: (hidden,)}[suffix]


def _expected_sent(suffix: str, live: torch.Tensor) -> torch.Tensor:
    """The checkpoint-oriented tensor by its definition, element by element (no table)."""
    if suffix == FC1W:  # gate_up[e, h, 2i + j] = fc1[j * n + i, h]
        n2, hidden = live.shape
        n = n2 // 2
        out = torch.empty(1, hidden, n2, dtype=live.dtype)
        for h, i, j in itertools.product(range(hidden), range(n), range(2)):
            out[0, h, 2 * i + j] = live[j * n + i, h]
        return out
    if suffix == FC1B:  # gate_up_bias[e, 2i + j] = fc1_bias[j * n + i]
        n = live.shape[0] // 2
        out = torch.empty(1, 2 * n, dtype=live.dtype)
        for i, j in itertools.product(range(n), range(2)):
            out[0, 2 * i + j] = live[j * n + i]
        return out
    if suffix == FC2W:  # down[e, i, h] = fc2[h, i]
        return live.T.reshape(1, *live.T.shape).clone()
    return live.reshape(1, -1).clone()  # down_bias[e] = fc2_bias


@pytest.mark.parametrize("suffix", sorted(REORIENTED))
@pytest.mark.parametrize(("n", "hidden"), list(itertools.product(range(1, 5), range(1, 5))))
def test_reorientation_is_the_checkpoints_order_and_inverts(suffix: str, n: int, hidden: int) -> None:
    r = REORIENTED[suffix]
    shape = _live_shape(suffix, n, hidden)
    live = torch.arange(float(np.prod(shape))).reshape(shape) + 1
    sent = to_sent(r, live)
    assert tuple(sent.shape) == sent_shape(r, shape)
    assert torch.equal(sent, _expected_sent(suffix, live))
    assert torch.equal(to_live(r, sent, shape), live)  # permute, then the inverse: the identity
    # A view where the table says so (the trainer's storage, no copy); gate/up interleaving is a
    # copy (with n = 1 there is nothing to interleave: a view too).
    shares = sent.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
    assert shares == (is_view(r) or n == 1)


@given(
    suffix=st.sampled_from(sorted(REORIENTED)),
    n=st.integers(1, 12),
    hidden=st.integers(1, 12),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_reorientation_round_trip_keeps_every_bit(
    suffix: str, n: int, hidden: int, dtype: torch.dtype
) -> None:
    r = REORIENTED[suffix]
    shape = _live_shape(suffix, n, hidden)
    bits = torch.randint(
        -(1 << 15), 1 << 15, shape, dtype=torch.int16 if dtype == torch.bfloat16 else torch.int32
    )
    live = bits.view(dtype)  # any bit pattern, NaNs included: nothing may compute on them
    back = to_live(r, to_sent(r, live), shape)
    assert torch.equal(back.view(bits.dtype), bits)


def test_a_wrong_table_entry_is_caught() -> None:
    # Negative control: no de-interleaving (a plain transpose) gives the right shape, wrong order.
    wrong = Reorient(halves=False, perm=(1, 0))
    live = torch.arange(24.0).reshape(6, 4) + 1
    sent = to_sent(wrong, live).reshape(1, 4, 6)
    assert sent.shape == _expected_sent(FC1W, live).shape
    assert not torch.equal(sent, _expected_sent(FC1W, live))


def test_reorientation_applies_to_gpt_oss_experts_only() -> None:
    name = "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"
    assert reorientation("gpt_oss", name) is REORIENTED[FC1W]
    assert reorientation("gpt_oss", "chunk1." + name) is REORIENTED[FC1W]
    assert reorientation("mixtral", name) is None  # Mixtral's live fc1 is the layout's tensor
    assert reorientation("gpt_oss", "decoder.layers.3.mlp.router.weight") is None


def _megatron_live(canon: dict[str, np.ndarray], layer: int, e: int) -> dict[str, np.ndarray]:
    """Megatron-Core's local expert tensors of global expert e (whole: etp=1), from the checkpoint."""
    p = f"model.layers.{layer}.mlp.experts."
    gate_up, bias = canon[p + "gate_up_proj"][e], canon[p + "gate_up_proj_bias"][e]
    gate, up = gate_up[:, 0::2].T, gate_up[:, 1::2].T  # (Im, H) each
    return {
        FC1W: np.concatenate([gate, up]),
        FC1B: np.concatenate([bias[0::2], bias[1::2]]),
        FC2W: canon[p + "down_proj"][e].T,
        FC2B: canon[p + "down_proj_bias"][e],
    }


SPECS = ["tp=1", "tp=2", "tp=2,ep=2,dp=2", "tp=2,pp=2", "tp=4,ep=4", "ep=4,dp=4"]


@pytest.mark.parametrize("spec", SPECS)
def test_layout_holds_megatrons_experts_reoriented(spec: str) -> None:
    m = build_manifest(load_model_config("tiny-gpt-oss"))
    parsed = ParallelSpec.parse(spec)
    canon = canon_of(m, seed=3)
    layers_per_stage = 4 // parsed.pp
    experts_per_rank = 8 // parsed.ep
    seen, ranks = 0, enumerate_ranks(parsed, Role.SOURCE)
    for coord in ranks:
        local = materialize(get_layout("megatron").shard(m, parsed, coord), canon)
        for j, k in itertools.product(range(layers_per_stage), range(experts_per_rank)):
            e = coord.ep_rank * experts_per_rank + k
            layer = coord.pp_rank * layers_per_stage + j
            for suffix, live in _megatron_live(canon, layer, e).items():
                got = local[f"decoder.layers.{j}.mlp.experts.local_experts.{k}.{suffix}"]
                want = to_sent(REORIENTED[suffix], torch.from_numpy(live.astype(np.int32))).numpy()
                np.testing.assert_array_equal(got, want, err_msg=f"{spec} {coord} {suffix}")
                seen += 1
    assert seen == len(ranks) * layers_per_stage * experts_per_rank * 4


@pytest.mark.parametrize("spec", [*SPECS, "pp=2,vpp=2", "tp=2"])
def test_gpt_oss_megatron_round_trip(spec: str) -> None:
    assert_round_trip("megatron", build_manifest(load_model_config("tiny-gpt-oss")), ParallelSpec.parse(spec))


def test_sinks_router_and_biases_by_megatrons_names() -> None:
    m = build_manifest(load_model_config("tiny-gpt-oss"))
    canon = canon_of(m, seed=5)
    r1 = materialize(
        get_layout("megatron").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.SOURCE, tp_rank=1)), canon
    )
    p, h = "decoder.layers.1.", "model.layers.1."
    np.testing.assert_array_equal(
        r1[p + "self_attention.core_attention.softmax_offset"], canon[h + "self_attn.sinks"][4:]
    )
    np.testing.assert_array_equal(
        r1[p + "self_attention.linear_proj.bias"], canon[h + "self_attn.o_proj.bias"]
    )
    np.testing.assert_array_equal(r1[p + "mlp.router.weight"], canon[h + "mlp.router.weight"])
    np.testing.assert_array_equal(r1[p + "mlp.router.bias"], canon[h + "mlp.router.bias"])
    # q/k/v biases grouped per query group as their weights: rank 1 holds groups 2 and 3.
    q, k = canon[h + "self_attn.q_proj.bias"], canon[h + "self_attn.k_proj.bias"]
    qkv = r1[p + "self_attention.linear_qkv.bias"]
    np.testing.assert_array_equal(qkv[:16], q[32:48])
    np.testing.assert_array_equal(qkv[16:24], k[16:24])


def test_te_spec_and_expert_tp_refused_in_one_line() -> None:
    m = build_manifest(load_model_config("tiny-gpt-oss"))
    with pytest.raises(LayoutError) as e:
        get_layout("megatron-te").validate(m, ParallelSpec(tp=2))
    assert str(e.value) == f"megatron-te: gpt_oss: {TE_REFUSAL}"
    # Megatron-Core 0.19.2 itself refuses biased experts at etp > 1 (TransformerConfig asserts).
    with pytest.raises(LayoutError) as e:
        get_layout("megatron").validate(m, ParallelSpec(tp=2, etp=2))
    assert str(e.value) == f"megatron: mlp.experts: etp=2: {ETP_REFUSAL}"
    get_layout("megatron").validate(m, ParallelSpec(tp=2))  # control: the local spec's rules hold it


def test_sent_shapes_are_the_layouts() -> None:
    m = build_manifest(load_model_config("tiny-gpt-oss"))
    shard = get_layout("megatron").shard(m, ParallelSpec(tp=2), RankCoord(role=Role.SOURCE, tp_rank=1))
    shapes = {t.name: t.shape for t in shard.tensors}
    for suffix, r in REORIENTED.items():
        declared = shapes[f"decoder.layers.0.mlp.experts.local_experts.7.{suffix}"]
        assert declared == sent_shape(r, _live_shape(suffix, 64, 64)), suffix


def _live(name: str, shape: tuple[int, ...]) -> LiveTensor:
    t = torch.arange(float(np.prod(shape))).reshape(shape)
    return LiveTensor(name, name, t, None, 1, expert=True)


def test_a_rank_reports_views_and_copies_only_while_read() -> None:
    x = "decoder.layers.0.mlp.experts.local_experts.1."
    fc1, fc2, norm = (
        _live(x + FC1W, (8, 3)),
        _live(x + FC2W, (3, 4)),
        _live("decoder.final_layernorm.weight", (3,)),
    )
    rank = ReorientedTensors("gpt_oss", [fc1, fc2, norm])
    registered = dict(rank.reported)  # what a participant holds (ws_init copies the dict)
    assert registered[norm.name] is norm.tensor
    assert registered[fc2.name].shape == (1, 4, 3) and registered[fc2.name]._base is not None  # a view
    stand_in = registered[fc1.name]
    assert stand_in.shape == (1, 3, 8) and stand_in.untyped_storage().nbytes() == 4  # one element
    with rank.materialized(registered) as moved:
        assert torch.equal(registered[fc1.name], _expected_sent(FC1W, fc1.tensor))
        assert moved() is None
    assert registered[fc1.name] is stand_in  # dropped again: no second copy between syncs
    # A step that writes the live parameter while a sync reads the copy is reported.
    with rank.materialized(registered) as moved:
        fc1.tensor.add_(1)
        assert moved() == fc1.name


def test_real_gpt_oss_plans_from_a_megatron_source_at_the_lower_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, dst = "tp=4,pp=2,dp=2,ep=4", "tp=8,ep=8"
    argv = [
        "plan",
        "--model",
        "gpt-oss-20b",
        "--src-layout",
        "megatron",
        "--src",
        src,
        "--dst",
        dst,
        "--json",
    ]
    code = cli.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["model_bytes"] == build_manifest(load_model_config("gpt-oss-20b")).nbytes
    assert summary["wire_bytes"] == summary["lower_bound_bytes"]


def test_a_step_during_a_sync_fails_the_source_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """MegatronSourceParticipant.ws_run: the sync reads a fresh copy of linear_fc1 in the layout's
    orientation; a write to the live parameter meanwhile turns the rank's result into
    SourceChanged and drops the kept (delta) bits. Control: without the write the result stands."""
    name = "decoder.layers.0.mlp.experts.local_experts.0." + FC1W
    fc1 = _live(name, (8, 3))
    rank = ReorientedTensors("gpt_oss", [fc1])
    participant = MegatronSourceParticipant()
    participant.ws_source = SimpleNamespace(reoriented=rank)  # type: ignore[assignment]
    coord = RankCoord(role=Role.SOURCE, node="127.0.0.1")
    participant.ws_init(role=Role.SOURCE, coord=coord, layout="megatron", tensors=rank.reported)
    read: list[torch.Tensor] = []

    def engine_run(self: WeightSyncParticipant, plan: str, *args: object) -> RankResult:
        read.append(self._ws_state().tensors[name].clone())  # what the engine would send
        if plan == "step meanwhile":
            fc1.tensor.add_(1)
        return RankResult(3, True, 0, 0, 0.0)

    monkeypatch.setattr(WeightSyncParticipant, "ws_run", engine_run)
    assert participant.ws_run("plan", "digest", "v1", None).ok
    assert torch.equal(read[-1], _expected_sent(FC1W, fc1.tensor))
    participant._ws_state().kept = object()  # type: ignore[assignment]
    result = participant.ws_run("step meanwhile", "digest", "v2", None)
    assert not result.ok and result.failure is not None
    assert result.failure.reason == SourceChanged.reason.value and result.failure.tensor == name
    assert participant._ws_state().kept is None
    assert participant._ws_state().tensors[name] is rank.reported[name]  # the copy is dropped again
