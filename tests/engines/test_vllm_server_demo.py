"""`weightsync demo --engine vllm-server --dump DIR`, run as a user runs it (a subprocess of the CLI).

Two dummy-weight TP 1 `vllm serve` servers with the weightsync backend receive tiny Qwen3 from
Megatron tp=2 sources in two syncs (v0, then v1) while a client per server keeps sending requests;
the oracle is a third server loaded by vLLM's own loader from DIR/reference.safetensors (v1), or
its answers from the reference cache (WEIGHTSYNC_REFERENCE_CACHE=1: that server is started only
when the cache does not hold them for exactly it; the demo says which in one line).
Checked here from the exit code and the files: each replica's generation.json (through
`/v1/completions`) equals the reference bit for bit and its dummy-weight generation differs on
every row (negative control); serving.json shows no failed request, requests in flight during the
syncs, two pauses per replica and both versions in vLLM's labels; the demo's own checker fails a
generation with one flipped logprob bit and a failed request (its exit-1 path, on this run's
data); no server process outlives the demo.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sync_runtime.demo.vllm_run import Outcome
from sync_runtime.demo.vllm_server_run import failed_checks
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.report import SyncReport
from sync_runtime.testing.vllm_models import CONFIGS
from sync_runtime.testing.vllm_oracle_keys import ORACLE_LINE
from sync_runtime.testing.weights import reference_weights

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 2
DEMO_TIMEOUT_S = 700
"""Under the module's 900 s: on a timeout the demo gets SIGTERM and 120 s to stop its servers."""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path
    seconds: float


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("vllm-server-demo") / "dump"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ["PYTHONPATH"]]),
        COLUMNS="160",
    )
    env["WEIGHTSYNC_REFERENCE_CACHE"] = "1"
    cmd = [sys.executable, "-m", "sync_runtime", "demo", "--engine", "vllm-server"]
    cmd += ["--dst", f"tp=1,replicas={REPLICAS}", "--dump", str(out), "--namespace", "vllm-server-demo-test"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the demo stops its servers on the way out
        stdout, stderr = proc.communicate(timeout=120)
        pytest.fail(f"demo still running after {DEMO_TIMEOUT_S}s: {stdout[-3000:]} {stderr[-3000:]}")
    seconds = time.monotonic() - started
    print(stdout[-6000:], stderr[-3000:], f"\ndemo wall time: {seconds:.1f}s")
    return Run(proc.returncode, stdout, stderr, out, seconds)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_demo_exits_zero_and_says_so(demo: Run) -> None:
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert f"OK: {REPLICAS}/{REPLICAS} replica(s) generate bit-identically" in demo.stdout


SERVER_PID = re.compile(r"\((APIServer|EngineCore|Worker)\S* pid=(\d+)\)")
"""vLLM's log prefix: the API server, its engine core and each worker name their process."""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _oracle_cached(demo: Run) -> bool:
    """Whether the reference's answers came from the cache (then no reference server ran)."""
    found = ORACLE_LINE.search(demo.stdout)
    assert found is not None, demo.stdout[-4000:]
    return found["source"].startswith("from the reference cache")


def test_the_demo_names_where_its_oracle_came_from(demo: Run) -> None:
    found = ORACLE_LINE.search(demo.stdout)
    assert found is not None, demo.stdout[-4000:]
    # a hit or a miss, the entry is there afterwards and holds both of the reference's calls
    entry = json.loads(Path(found["path"]).read_text())
    assert len(entry["value"]["calls"]) == 2 and entry["key"]["engine"]["server"] == "vllm serve"
    servers = REPLICAS + (0 if _oracle_cached(demo) else 1)
    assert f"and {servers} vLLM servers ready" in demo.stdout


def test_no_server_process_outlives_the_demo(demo: Run) -> None:
    logs = sorted((demo.out / "server-logs").iterdir())
    reference = [] if _oracle_cached(demo) else ["reference.log"]
    assert [p.name for p in logs] == [*reference, *(f"replica-{k}.log" for k in range(REPLICAS))]
    for log in logs:
        found = {(kind, int(pid)) for kind, pid in SERVER_PID.findall(log.read_text())}
        assert {kind for kind, _ in found} == {"APIServer", "EngineCore", "Worker"}, log.name
        assert [(kind, pid) for kind, pid in found if _alive(pid)] == [], log.name


def test_serving_json(demo: Run) -> None:
    serving = _json(demo.out / "serving.json")
    print("serving.json:", json.dumps({k: v for k, v in serving.items() if k != "replicas"}))
    assert serving["failed"] == 0, serving["replicas"]
    assert serving["requests"] > 0 and 0 < serving["during_sync"] <= serving["requests"]
    assert serving["requests"] == sum(r["requests"] for r in serving["replicas"])
    assert all(r["requests"] > 0 for r in serving["replicas"])  # every replica was served
    # per replica, one pause per sync (the apply's), apart from the transfer
    assert len(serving["pause_seconds"]) == REPLICAS
    assert all(len(p) == 2 and all(0 < s < 60 for s in p) for p in serving["pause_seconds"])
    # vLLM labelled answers with each sync's version (the clients ran until both were seen)
    assert {"v0", "v1"} <= set(serving["versions_seen"])
    assert len(serving["sync_seconds"]) == 2


def test_reference_checkpoint_and_report(demo: Run) -> None:
    got = load_file(str(demo.out / "reference.safetensors"))
    want = reference_weights(build_manifest(CONFIGS["qwen3"]), 0, "v1")
    assert got.keys() == want.keys()
    for name, bits in want.items():
        assert np.array_equal(got[name].view(torch.uint16).numpy(), bits), name
    link = demo.out / "reference-model" / "model.safetensors"
    assert link.resolve() == (demo.out / "reference.safetensors").resolve()
    report = _json(demo.out / "report.json")
    assert report["version"] == "v1" and report["result"] == "Succeeded"
    assert [(s["version"], s["result"]) for s in report["syncs"]] == [
        ("v0", "Succeeded"),
        ("v1", "Succeeded"),
    ]


@pytest.mark.parametrize("replica", range(REPLICAS))
def test_generation_equals_the_reference_bit_for_bit(demo: Run, replica: int) -> None:
    gen = _json(demo.out / "destination" / f"replica-{replica}" / "generation.json")
    prompts, ref = gen["prompt_token_ids"], gen["reference"]
    assert len(prompts) >= 4 and all(len(p) >= 8 for p in prompts)
    for key in ("token_ids", "before_sync_token_ids"):
        assert len(gen[key]) == len(prompts) and all(len(r) == 16 for r in gen[key]), key
    assert [len(r) for r in gen["logprobs"]] == [16] * len(prompts)
    assert all(lp <= 0.0 for row in gen["logprobs"] for lp in row)
    assert gen["token_ids"] == ref["token_ids"]
    assert gen["logprobs"] == ref["logprobs"]  # exact float equality, every token
    # negative control: the same server on its dummy weights generates otherwise, row by row
    assert all(b != a for b, a in zip(gen["before_sync_token_ids"], gen["token_ids"], strict=True))
    sums = _json(demo.out / "destination" / f"replica-{replica}" / "pp0-tp0.checksums.json")
    assert sums["applied"] == sums["expected"] and sums["applied"]


def _flip_lowest_bit(x: float) -> float:
    (bits,) = struct.unpack("<Q", struct.pack("<d", x))
    return struct.unpack("<d", struct.pack("<Q", bits ^ 1))[0]


def test_the_checker_fails_one_flipped_logprob_bit_and_a_failed_request(demo: Run) -> None:
    """The demo's exit-1 checks, on this run's dumped data: the checker passes it as dumped, and
    names the replica when one logprob differs in its lowest bit, and the failed request."""
    gen = _json(demo.out / "destination" / "replica-0" / "generation.json")
    rows = zip(gen["reference"]["token_ids"], gen["reference"]["logprobs"], strict=True)
    ref = [{"token_ids": t, "logprobs": lp} for t, lp in rows]
    after = [
        {"token_ids": t, "logprobs": list(lp)}
        for t, lp in zip(gen["token_ids"], gen["logprobs"], strict=True)
    ]
    before = [{"token_ids": t, "logprobs": []} for t in gen["before_sync_token_ids"]]
    doc = _json(demo.out / "report.json")
    reports = [SyncReport.model_validate({k: v for k, v in doc.items() if k != "syncs"})]
    applied = [_json(demo.out / "destination" / "replica-0" / "pp0-tp0.checksums.json")]
    serving = _json(demo.out / "serving.json")
    assert failed_checks(reports, [Outcome(0, before, after, applied)], ref, serving) == []
    after[2]["logprobs"][5] = _flip_lowest_bit(after[2]["logprobs"][5])
    broken = {**serving, "failed": 1, "replicas": [{"errors": ["ReadTimeout()"]}]}
    assert failed_checks(reports, [Outcome(0, before, after, applied)], ref, broken) == [
        f"replica 0 after the syncs: {len(ref) - 1}/{len(ref)} rows equal the reference's",
        f"1 of {serving['requests']} client requests failed (ReadTimeout())",
    ]
