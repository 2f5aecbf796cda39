"""gpt-oss's `vllm` layout plus the apply's loader steps (engines/vllm_family_load.py) give, bit for
bit, what vLLM 0.32's own loader gives (`GptOssModel._load_weights_other`, unquantized path).

The loader's steps are restated here from vLLM's source (the engine env holds them; this venv has
no vLLM): TP without EP: w13 = gate_up[:, :, 2lo:2hi].permute(0, 2, 1), w2 = down[:, lo:hi, :]
.permute(0, 2, 1), w13_bias = gate_up_bias[:, 2lo:2hi], w2_bias = down_bias on TP rank 0 and zeros
elsewhere; EP: experts [e0, e1) whole, w2_bias of those experts on every rank. Parameter shapes as
vLLM's FusedMoE allocates them: w13 (E', 2n, H), w2 (E', H, n). Drawn over experts, hidden and
intermediate sizes, TP and EP; tests/engines/test_vllm_families.py checks the same against a live
engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.engines import vllm_family_load as family_load
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit

EXPERTS = "model.layers.0.mlp.experts."
LOCAL = "model.layers.0.mlp.experts.routed_experts."


def _canonical(manifest_tensors: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Distinct values per element (int16 bits of bf16 tensors), so any misplacement shows."""
    rng = np.random.default_rng(seed)
    return {n: rng.integers(0, 2**16, size=s, dtype=np.uint16) for n, s in manifest_tensors.items()}


def _vllm_loader(
    canon: dict[str, np.ndarray], spec: ParallelSpec, coord: RankCoord
) -> dict[str, torch.Tensor]:
    """vLLM 0.32's gpt-oss expert loading for one rank, on the canonical tensors of layer 0."""
    gate_up, down = (
        torch.from_numpy(canon[EXPERTS + s].astype(np.int32)) for s in ("gate_up_proj", "down_proj")
    )
    gu_bias, d_bias = (
        torch.from_numpy(canon[EXPERTS + s].astype(np.int32)) for s in ("gate_up_proj_bias", "down_proj_bias")
    )
    if spec.ep > 1:
        per = gate_up.shape[0] // spec.ep
        e = slice(coord.ep_rank * per, (coord.ep_rank + 1) * per)
        return {
            "w13_weight": gate_up[e].permute(0, 2, 1),
            "w2_weight": down[e].permute(0, 2, 1),
            "w13_bias": gu_bias[e],
            "w2_bias": d_bias[e],
        }
    n = down.shape[1] // spec.tp
    lo, hi = coord.tp_rank * n, (coord.tp_rank + 1) * n
    return {
        "w13_weight": gate_up[:, :, 2 * lo : 2 * hi].permute(0, 2, 1),
        "w2_weight": down[:, lo:hi, :].permute(0, 2, 1),
        "w13_bias": gu_bias[:, 2 * lo : 2 * hi],
        "w2_bias": d_bias if coord.tp_rank == 0 else torch.zeros_like(d_bias),
    }


@settings(max_examples=40, deadline=None)
@given(
    experts=st.sampled_from([2, 4, 8]),
    hidden=st.sampled_from([16, 32, 48]),
    im=st.sampled_from([8, 16, 24]),
    tp=st.sampled_from([1, 2, 4]),
    use_ep=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layout_and_apply_equal_vllms_loader(
    experts: int, hidden: int, im: int, tp: int, use_ep: bool, seed: int
) -> None:
    config = load_model_config("tiny-gpt-oss") | {
        "num_local_experts": experts,
        "hidden_size": hidden,
        "intermediate_size": im,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
    }
    spec = ParallelSpec(tp=tp, ep=tp if use_ep and experts % tp == 0 else 1)
    manifest = build_manifest(config)
    canon = _canonical({t.name: t.shape for t in manifest.tensors}, seed)
    n = im // tp if spec.ep == 1 else im
    e_local = experts // spec.ep
    for r in range(tp):
        coord = RankCoord(role=Role.DESTINATION, tp_rank=r, ep_rank=r if spec.ep > 1 else 0)
        shard = get_layout("vllm").shard(manifest, spec, coord)
        got = materialize(shard, canon)
        want = _vllm_loader(canon, spec, coord)
        params = {  # vLLM's FusedMoE parameter shapes
            "w13_weight": (e_local, 2 * n, hidden),
            "w2_weight": (e_local, hidden, n),
            "w13_bias": (e_local, 2 * n),
            "w2_bias": (e_local, hidden),
        }
        for pname, shape in params.items():
            name = LOCAL + pname
            if pname == "w2_bias" and spec.ep == 1 and r > 0:
                assert name not in got  # not received: the apply zeroes it, as the loader does
                received = torch.zeros(shape, dtype=torch.int32)
            else:
                assert got[name].shape == family_load.received_shape("gpt_oss", pname, shape)
                received = family_load.to_param(
                    "gpt_oss", pname, torch.from_numpy(got[name].astype(np.int32))
                )
            assert tuple(received.shape) == shape
            assert torch.equal(received, want[pname]), (pname, r)


def test_other_families_are_untouched() -> None:
    assert family_load.received_shape("qwen3_moe", "w13_weight", (4, 8, 16)) == (4, 8, 16)
    t = torch.arange(24).reshape(2, 3, 4)
    assert family_load.to_param("mixtral", "w2_weight", t) is t
    assert family_load.received_shape("gpt_oss", "w13_bias", (4, 8)) == (4, 8)
