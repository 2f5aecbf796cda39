"""`weightsync demo --engine vllm --dump DIR`, run as a user runs it (a subprocess of the CLI).

Two dummy-initialised TP 1 vLLM engines (TP 1: two worker processes in all, the least memory
for two replicas) receive tiny Qwen3 from Megatron tp=2 sources; the demo's oracle is a third
engine loaded by vLLM's own loader from DIR/reference.safetensors, or its outputs from the
reference cache (WEIGHTSYNC_REFERENCE_CACHE=1: started only when the cache does not hold them for
exactly this oracle; the demo says which in one line). Checked here from the files:
the reference checkpoint holds exactly the canonical weights, each replica's generation.json has
the documented shape, equals the reference bit for bit, and its dummy-weight generation differs
(negative control); the exit code is 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.vllm_models import CONFIGS
from sync_runtime.testing.vllm_oracle_keys import ORACLE_LINE
from sync_runtime.testing.weights import reference_weights

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("vllm-demo") / "dump"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ["PYTHONPATH"]]),
        COLUMNS="160",
    )
    env["WEIGHTSYNC_REFERENCE_CACHE"] = "1"
    cmd = [sys.executable, "-m", "sync_runtime", "demo", "--engine", "vllm"]
    cmd += ["--dst", f"tp=1,replicas={REPLICAS}", "--dump", str(out), "--namespace", "vllm-demo-test"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    return proc, out


def test_demo_exits_zero_and_says_so(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, _ = demo
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"OK: {REPLICAS}/{REPLICAS} replica(s) generate bit-identically" in proc.stdout


def test_the_demo_names_where_its_oracle_came_from(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, _ = demo
    found = ORACLE_LINE.search(proc.stdout)
    assert found is not None, proc.stdout[-4000:]
    # a hit or a miss, the entry is there afterwards and holds both of the oracle's calls
    entry = json.loads(Path(found["path"]).read_text())
    assert len(entry["value"]["calls"]) == 2 and entry["key"]["outputs"]["generate_calls"] == 2
    engines = REPLICAS + (0 if found["source"].startswith("from the reference cache") else 1)
    assert f"and {engines} vLLM engines ready" in proc.stdout


def test_reference_checkpoint_holds_the_canonical_weights(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = demo
    got = load_file(str(out / "reference.safetensors"))
    want = reference_weights(build_manifest(CONFIGS["qwen3"]), 0, "v1")
    assert got.keys() == want.keys()
    for name, bits in want.items():
        assert got[name].dtype == torch.bfloat16, name
        assert np.array_equal(got[name].view(torch.uint16).numpy(), bits), name
    # the oracle engine read this very file (vLLM's loader follows the model dir's symlink)
    link = out / "reference-model" / "model.safetensors"
    assert link.resolve() == (out / "reference.safetensors").resolve()
    assert json.loads((out / "report.json").read_text())["result"] == "Succeeded"


@pytest.mark.parametrize("replica", range(REPLICAS))
def test_generation_equals_the_reference_bit_for_bit(
    demo: tuple[subprocess.CompletedProcess[str], Path], replica: int
) -> None:
    _, out = demo
    gen = json.loads((out / "destination" / f"replica-{replica}" / "generation.json").read_text())
    prompts, ref = gen["prompt_token_ids"], gen["reference"]
    assert len(prompts) >= 4 and all(len(p) >= 8 for p in prompts)
    for key in ("token_ids", "before_sync_token_ids"):
        assert len(gen[key]) == len(prompts) and all(len(r) == 16 for r in gen[key]), key
    assert [len(r) for r in gen["logprobs"]] == [16] * len(prompts)
    assert all(lp <= 0.0 for row in gen["logprobs"] for lp in row)  # log-probabilities of chosen tokens
    assert gen["token_ids"] == ref["token_ids"]
    assert gen["logprobs"] == ref["logprobs"]  # exact float equality, every token
    # negative control: the same engine on its dummy weights generates otherwise, row by row
    assert all(b != a for b, a in zip(gen["before_sync_token_ids"], gen["token_ids"], strict=True))
    ranks = sorted((out / "destination" / f"replica-{replica}").glob("pp*-tp*.checksums.json"))
    assert [r.name for r in ranks] == ["pp0-tp0.checksums.json"]  # TP 1: one rank per replica
    for rank in ranks:
        sums = json.loads(rank.read_text())
        assert sums["applied"] == sums["expected"] and sums["applied"]
