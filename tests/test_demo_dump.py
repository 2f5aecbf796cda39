"""`weightsync demo --dump DIR`, checked independently of the layouts package.

Runs the real CLI (embedded Ray cluster, default model and topologies), then rebuilds every
destination rank's tensors from reference.safetensors with numpy slicing written here from
design §4.1 for tiny-qwen3-moe (vllm tp=2, ep=2, pp=1, 2 replicas) and compares names, shapes
and bytes with the dumped files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

TP = 2


def _bits(t: torch.Tensor) -> np.ndarray:
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.uint16).numpy()


def _rows(a: np.ndarray, r: int, t: int) -> np.ndarray:
    n = a.shape[0]
    return a[r * n // t : (r + 1) * n // t]


def _cols(a: np.ndarray, r: int, t: int) -> np.ndarray:
    n = a.shape[-1]
    return a[..., r * n // t : (r + 1) * n // t]


def _vocab(a: np.ndarray, r: int, t: int) -> np.ndarray:
    vp = -(-a.shape[0] // 64) * 64  # V rounded up to a multiple of 64; rows >= V are zero
    padded = np.zeros((vp, a.shape[1]), dtype=a.dtype)
    padded[: a.shape[0]] = a
    return _rows(padded, r, t)


def expected_rank(ref: dict[str, np.ndarray], cfg: dict, r: int) -> dict[str, np.ndarray]:
    """design §4.1 for qwen3_moe with EP = TP, one PP stage."""
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    experts, dense = cfg["num_experts"], set(cfg["mlp_only_layers"])
    out = {
        "model.embed_tokens.weight": _vocab(ref["model.embed_tokens.weight"], r, TP),
        "lm_head.weight": _vocab(ref["lm_head.weight"], r, TP),
        "model.norm.weight": ref["model.norm.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q = ref[p + "self_attn.q_proj.weight"].reshape(nh, d, -1)
        k = ref[p + "self_attn.k_proj.weight"].reshape(nkv, d, -1)
        v = ref[p + "self_attn.v_proj.weight"].reshape(nkv, d, -1)
        assert nkv >= TP
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [
                _rows(q, r, TP).reshape(-1, q.shape[-1]),
                _rows(k, r, TP).reshape(-1, k.shape[-1]),
                _rows(v, r, TP).reshape(-1, v.shape[-1]),
            ]
        )
        out[p + "self_attn.o_proj.weight"] = _cols(ref[p + "self_attn.o_proj.weight"], r, TP)
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[p + norm + ".weight"] = ref[p + norm + ".weight"]
        if i in dense:
            out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
                [_rows(ref[p + "mlp.gate_proj.weight"], r, TP), _rows(ref[p + "mlp.up_proj.weight"], r, TP)]
            )
            out[p + "mlp.down_proj.weight"] = _cols(ref[p + "mlp.down_proj.weight"], r, TP)
            continue
        out[p + "mlp.gate.weight"] = ref[p + "mlp.gate.weight"]
        mine = range(r * experts // TP, (r + 1) * experts // TP)  # EP: whole experts, in order
        e = p + "mlp.experts."
        # vLLM 0.32 names the routed experts' fused weights under `routed_experts.`
        out[e + "routed_experts.w13_weight"] = np.stack(
            [np.concatenate([ref[f"{e}{x}.gate_proj.weight"], ref[f"{e}{x}.up_proj.weight"]]) for x in mine]
        )
        out[e + "routed_experts.w2_weight"] = np.stack([ref[f"{e}{x}.down_proj.weight"] for x in mine])
    return out


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> tuple[Path, float, str]:
    out = tmp_path_factory.mktemp("dump")
    exe = Path(sys.executable).parent / "weightsync"
    started = time.monotonic()
    proc = subprocess.run([str(exe), "demo", "--dump", str(out)], capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, wall, proc.stdout


def test_demo_prints_a_verified_summary(dump):
    _, wall, stdout = dump
    assert wall < 120, f"weightsync demo took {wall:.0f}s, the budget is 2 minutes"
    assert "WeightSync demo summary" in stdout and "OK in" in stdout
    assert stdout.count("yes (4 ranks)") == 2  # both syncs verified on every destination rank
    assert "no (cold)" in stdout and "│ plan + group reused │" in stdout


def test_manifest_and_report(dump):
    out, _, _ = dump
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16"
    assert manifest["model"]["model_type"] == "qwen3_moe"
    assert manifest["source"] == {"layout": "megatron", "tp": 2, "pp": 2, "dp": 1, "ep": 2, "etp": 1}
    assert manifest["destination"] == {"layout": "vllm", "tp": 2, "pp": 1, "ep": 2, "replicas": 2}
    report = json.loads((out / "report.json").read_text())
    assert report["result"] == "Succeeded" and report["version"] == "v2" and report["planCached"] is True
    assert report["movedBytes"] == report["plannedBytes"] > 0
    assert set(report["stages"]) == {"discover", "plan", "connect", "transfer", "verify", "commit"}


def test_destination_files_match_design_4_1(dump):
    out, _, _ = dump
    cfg = json.loads((out / "manifest.json").read_text())["model"]
    ref = {k: _bits(v) for k, v in load_file(str(out / "reference.safetensors")).items()}
    files = sorted(p.relative_to(out).as_posix() for p in (out / "destination").rglob("*.safetensors"))
    assert files == [f"destination/replica-{k}/pp0-tp{r}.safetensors" for k in range(2) for r in range(TP)]
    for k in range(2):
        for r in range(TP):
            got = load_file(str(out / f"destination/replica-{k}/pp0-tp{r}.safetensors"))
            want = expected_rank(ref, cfg, r)
            assert sorted(got) == sorted(want), f"replica {k} rank {r}: names differ"
            for name, expected in want.items():
                actual = _bits(got[name])
                assert actual.shape == expected.shape, (k, r, name, actual.shape, expected.shape)
                assert np.array_equal(actual, expected), (k, r, name)
