"""Every subcommand answers bad input with one line on stderr and exit 2, before anything starts.

In-process through `main([...])`: the same code path as the console script, without a
subprocess per case. `demo` cases must fail in the CLI's checks, before Ray or any actor starts
(a started embedded cluster would take tens of seconds: the timing bound is the control).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.cli.main import main

pytestmark = pytest.mark.unit

MOE = ["--model", "tiny-qwen3-moe"]
DST = ["--dst", "tp=2,replicas=2"]
VALID_SPEC = Path(__file__).resolve().parents[1] / "examples" / "weightsync.yaml"

MANIFESTS = {
    "list.yaml": "- a\n- b\n",
    "broken.yaml": "spec: {version: v1\n",
    "bucket.yaml": VALID_SPEC.read_text().replace("bucketMb: 64", "bucketMb: -1"),
    "nosource.yaml": "spec:\n  version: v1\n  destinations: []\n",
    "typo.yaml": VALID_SPEC.read_text().replace("actorPrefix: trainer-", "actorPrefx: trainer-"),
    "tp3.yaml": VALID_SPEC.read_text().replace("{tp: 2, pp: 2, dp: 2}", "{tp: 3, pp: 2, dp: 2}"),
    "model.yaml": VALID_SPEC.read_text().replace("model: tiny-llama", "model: nope"),
}

CASES: list[tuple[list[str], str]] = [
    ([], "the following arguments are required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # plan
    (["plan", "--model", "nope", "--src", "tp=1", "--dst", "tp=1"], "'nope' is neither a preset"),
    (["plan", "--src", "tp=1", *DST], "required: --model"),
    (["plan", *MOE, "--src", "tp=3", *DST], "nh=8 not divisible by tp=3"),
    (["plan", *MOE, "--src", "tp=x", *DST], "tp=x"),
    (["plan", *MOE, "--src", "tp=2", *DST, "--gpus-per-node", "0"], "--gpus-per-node=0: must be >= 1"),
    (["plan", *MOE, "--src", "tp=2", *DST, "--dst-layout", "vllm", "--dst-layout", "vllm"], "2 --dst-layout"),
    (["plan", *MOE, "--src", "tp=2", *DST, "--relay", "maybe"], "invalid choice: 'maybe'"),
    (["plan", "--model", "tiny-deepseek-v3", "--src", "tp=2,pp=2", *DST], "L=3 layers not divisible by pp=2"),
    # simulate
    (
        ["simulate", "--model", "kimi-k2", "--src", "tp=8", "--dst", "tp=8"],
        "simulate holds every rank's copy",
    ),
    (["simulate", *MOE, "--src", "tp=0", *DST], "tp=0"),
    (["simulate", *MOE, "--src", "tp=2", *DST, "--seed", "abc"], "invalid int value: 'abc'"),
    (["simulate", *MOE, "--src", "tp=2", "--src-layout", "nope", *DST], "nope"),
    (["simulate", *MOE, "--src", "tp=2", "--dst", "tp=3,replicas=2"], "not divisible by tp=3"),
    # demo: all refused before Ray starts
    (["demo", "--model", "nope"], "'nope' is neither a preset"),
    (["demo", *MOE, "--src", "tp=3"], "nh=8 not divisible by tp=3"),
    (["demo", "--model", "tiny-deepseek-v3", "--src", "tp=2,pp=2", *DST], "L=3 layers not divisible"),
    (["demo", "--engine", "sglang"], "invalid choice: 'sglang'"),
    (["demo", "--source", "megatron-core", "--ray-address", "127.0.0.1:1"], "embedded cluster only"),
    (["demo", "--verify-only", "--expect-version", "v1"], "need --ray-address"),
    (["demo", "--verify-only", "--ray-address", "127.0.0.1:1"], "--verify-only needs --expect-version"),
    (["demo", "--timeout", "0"], "--timeout=0: must be >= 1"),
    (["demo", "--dst", "tp=2,replicas=x"], "replicas=x"),
    # run
    (["run"], "run needs --config FILE"),
    (["run", "--kubernetes"], "needs --namespace and --name"),
    (["run", "--config", "/nonexistent/ws.yaml"], "No such file or directory"),
    (["run", "--config", "{tmp}/list.yaml"], "expected a mapping, got list"),
    (["run", "--config", "{tmp}/broken.yaml"], "not YAML"),
    (["run", "--config", "{tmp}/bucket.yaml"], "spec.transport.bucketMb:"),
    (["run", "--config", "{tmp}/nosource.yaml"], "spec.source: Field required"),
    (["run", "--config", "{tmp}/typo.yaml"], "spec.source.actorPrefx: Extra inputs are not permitted"),
    (["run", "--config", "{tmp}/tp3.yaml"], "nh=8 not divisible by tp=3"),  # planned before Ray
    (["run", "--config", "{tmp}/model.yaml"], "'nope' is neither a preset"),
]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("manifests")
    for name, text in MANIFESTS.items():
        (folder / name).write_text(text)
    return folder


def test_table_covers_every_subcommand() -> None:
    commands = {c[0][0] for c in CASES if c[0]}
    assert {"demo", "plan", "simulate", "run"} <= commands
    assert len(CASES) >= 20


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[" ".join(c[0]) or "(none)" for c in CASES])
def test_bad_input_is_one_line_exit_2(
    argv: list[str], expected: str, manifests: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(manifests)) for a in argv]
    started = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "weightsync" in lines[0] and "error:" in lines[0]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert elapsed < 10, f"{argv}: {elapsed:.1f}s: something started before the input was checked"


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """--debug re-raises the error (the traceback a developer wants); without it, one line."""
    from sync_runtime.errors import LayoutError

    with pytest.raises(LayoutError, match="not divisible by tp=3"):
        main(["--debug", "plan", *MOE, "--src", "tp=3", *DST])
    with pytest.raises(LayoutError):
        main(["plan", *MOE, "--src", "tp=3", *DST, "--debug"])


def test_good_input_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Control: the checks do not refuse a valid plan."""
    assert main(["plan", *MOE, "--src", "tp=2,pp=2,ep=2", "--dst", "tp=2,ep=2,replicas=2", "--json"]) == 0
    assert '"digest"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["demo", "--engine", "vllm", "--dst", "tp=1,replicas=2"], 0),  # the vLLM demo's own preset
        (["demo", "--engine", "vllm", "--model", "vllm-tiny-deepseek-v3", "--dst", "tp=2"], 0),
        (["demo", "--engine", "vllm", "--dst", "tp=3,replicas=2"], 2),  # 4 heads over tp=3
    ],
)
def test_the_vllm_demos_presets_are_planned_before_anything_starts(
    argv: list[str], code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[object] = []
    module = cli._load(cli.DELEGATES["demo"])
    monkeypatch.setattr(module, "run", lambda args: ran.append(args) or 0)
    assert cli.main(argv) == code and len(ran) == (code == 0)
