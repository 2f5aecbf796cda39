"""`weightsync demo --source megatron-core --steps 3 --delta auto|off --dump DIR`, checked from the
dump alone.

Two runs of the real CLI. The `--delta auto` run is README's command, run as written in a shell
(tests/engines/test_doc_demos.py leaves it to this module, which checks its dump): real
Megatron-Core trainer ranks (tiny Qwen3, tp=2, bf16 with fp32 main weights, Adam at lr 1e-6 from
std-0.02 weights) sync into two tp=1 replicas after each of three steps. The destination shards
in the dump are rebuilt here from reference.safetensors with numpy (vLLM's fused qkv_proj and
gate_up_proj at tp=1, written out below, not taken from the layouts package) and compared bit for
bit, with negative controls (one flipped bit in the reference, q and k swapped in the fused
tensor). report.json must list every sync: the first in full, the next two as deltas with a few
percent of the wire; with `--delta off` every sync is full and the destinations end on the same
bytes.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.test_doc_commands import run_as_written

pytestmark = pytest.mark.engines

STEPS = 3
DOCUMENTED = (
    '$V/bin/weightsync demo --source megatron-core --model tiny-qwen3 --src tp=2 --dst "tp=1,replicas=2" '
    "--steps 3 --lr 1e-6 --delta auto --dump /tmp/ws-megatron"
)
"""README's command (test_doc_demos fails when the docs no longer show it as written)."""


def _run(command: str) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = run_as_written(command, timeout_s=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"{command}: {time.monotonic() - started:.1f}s\n{proc.stdout}")
    assert "OK in" in proc.stdout and proc.stdout.count("bit-exact") == STEPS
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    documented = Path(shlex.split(DOCUMENTED)[-1])
    subprocess.run(["rm", "-rf", str(documented)], check=True)
    _run(DOCUMENTED)
    off = tmp_path_factory.mktemp("megatron-off")
    _run(DOCUMENTED.replace("--delta auto", "--delta off").replace(str(documented), str(off)))
    return {"auto": documented, "off": off}


def _bits(t: torch.Tensor) -> np.ndarray:
    """Bit patterns: bf16 weights as int16, the fp32 norms (a bf16 Megatron model keeps its
    RMSNorm weights in fp32) as int32."""
    assert t.dtype in (torch.bfloat16, torch.float32), t.dtype
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy()


def expected_shard(ref: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """A vLLM tp=1 rank of a dense Qwen3: q, k, v stacked into qkv_proj, gate and up into
    gate_up_proj (vLLM's packed modules), everything else under its HF name."""
    out = {n: a for n, a in ref.items() if "q_proj" not in n and "k_proj" not in n and "v_proj" not in n}
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = [ref[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(qkv)
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [out.pop(p + "mlp.gate_proj.weight"), out.pop(p + "mlp.up_proj.weight")]
        )
    return out


def mismatches(out: Path, ref: dict[str, np.ndarray]) -> list[str]:
    """What differs between the dumped destination shards and `ref` rebuilt as above."""
    layers = json.loads((out / "manifest.json").read_text())["model"]["num_hidden_layers"]
    want, problems = expected_shard(ref, layers), []
    for replica in range(2):
        got = {
            n: _bits(t)
            for n, t in load_file(str(out / f"destination/replica-{replica}/pp0-tp0.safetensors")).items()
        }
        if sorted(got) != sorted(want):
            problems.append(f"replica {replica}: names {sorted(set(got) ^ set(want))}")
            continue
        problems += [
            f"replica {replica}: {n}"
            for n, a in want.items()
            if got[n].dtype != a.dtype or not np.array_equal(got[n], a)
        ]
    return problems


def reference(out: Path) -> dict[str, np.ndarray]:
    return {n: _bits(t) for n, t in load_file(str(out / "reference.safetensors")).items()}


def test_dump_has_the_default_demos_files(runs: dict[str, Path]) -> None:
    out = runs["auto"]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == [
        "destination/replica-0/pp0-tp0.safetensors",
        "destination/replica-1/pp0-tp0.safetensors",
        "manifest.json",
        "reference.safetensors",
        "report.json",
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == {"layout": "megatron", "tp": 2, "pp": 1, "dp": 1, "ep": 1, "etp": 1}
    assert manifest["destination"] == {"layout": "vllm", "tp": 1, "pp": 1, "ep": 1, "replicas": 2}
    assert manifest["model"]["model_type"] == "qwen3"


def test_destination_shards_equal_the_reference_bit_for_bit(runs: dict[str, Path]) -> None:
    out = runs["auto"]
    ref = reference(out)
    assert mismatches(out, ref) == []
    # Negative controls: one flipped bit in the reference; q and k swapped in the fused tensor.
    flipped = {n: a.copy() for n, a in ref.items()}
    flipped["model.layers.1.mlp.down_proj.weight"].reshape(-1)[5] ^= 1
    down = "model.layers.1.mlp.down_proj.weight"
    assert mismatches(out, flipped) == [f"replica 0: {down}", f"replica 1: {down}"]
    swapped = dict(ref)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    swapped[q], swapped[k] = ref[k], ref[q]
    assert "replica 0: model.layers.0.self_attn.qkv_proj.weight" in mismatches(out, swapped)


def test_report_lists_every_sync_first_full_then_deltas(runs: dict[str, Path]) -> None:
    report = json.loads((runs["auto"] / "report.json").read_text())
    assert report["version"] == f"v{STEPS}" and report["result"] == "Succeeded"
    syncs = report["syncs"]
    assert [s["version"] for s in syncs] == [f"v{k}" for k in range(1, STEPS + 1)]
    assert all(s["result"] == "Succeeded" for s in syncs)
    first, *later = syncs
    assert first["encoding"] == "full" and first["wireBytes"] == first["fullBytes"] > 0
    assert first["changedFraction"] is None  # nothing was compared against a base
    for s in later:
        assert s["encoding"] == "delta", s
        assert s["fullBytes"] == first["fullBytes"]
        assert 0 < s["changedFraction"] < 0.2, s  # an RL-like step changes a few % of bf16 elements
        assert s["wireBytes"] < 0.5 * s["fullBytes"], s
    assert report["encoding"] == "delta" and report["wireBytes"] == later[-1]["wireBytes"]


def test_delta_off_syncs_in_full_to_the_same_bytes(runs: dict[str, Path]) -> None:
    off, auto = runs["off"], runs["auto"]
    syncs = json.loads((off / "report.json").read_text())["syncs"]
    assert len(syncs) == STEPS
    for s in syncs:
        assert (
            s["encoding"] == "full" and s["wireBytes"] == s["fullBytes"] and s["changedFraction"] is None
        ), s
    assert mismatches(off, reference(off)) == []
    # The same training (seeded, one thread per rank) gives the same weights; both encodings
    # leave the same bytes at every destination rank.
    for name in (
        "reference.safetensors",
        *(f"destination/replica-{k}/pp0-tp0.safetensors" for k in range(2)),
    ):
        assert (off / name).read_bytes() == (auto / name).read_bytes(), name
