"""`weightsync demo --source megatron-core --steps N --lr LR --delta auto|off`: bad values are one
line on stderr and exit 2 before anything starts (cli/checks.py); good ones reach the demo with
the defaults filled in (the demo's module `run` is replaced by a recorder: no Ray starts)."""

from __future__ import annotations

import argparse
import time

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.cli.main import main

pytestmark = pytest.mark.unit

MEGATRON = ["demo", "--source", "megatron-core", "--model", "tiny-qwen3", "--src", "tp=2", "--dst", "tp=1"]

CASES: list[tuple[list[str], str]] = [
    ([*MEGATRON, "--steps", "0"], "--steps=0: must be >= 1"),
    ([*MEGATRON, "--steps", "-2"], "--steps=-2: must be >= 1"),
    ([*MEGATRON, "--steps", "two"], "invalid int value: 'two'"),
    ([*MEGATRON, "--lr", "0"], "--lr=0.0: must be a finite number > 0"),
    ([*MEGATRON, "--lr=-1e-6"], "--lr=-1e-06: must be a finite number > 0"),
    ([*MEGATRON, "--lr", "nan"], "--lr=nan: must be a finite number > 0"),
    ([*MEGATRON, "--lr", "inf"], "--lr=inf: must be a finite number > 0"),
    ([*MEGATRON, "--lr", "fast"], "invalid float value: 'fast'"),
    ([*MEGATRON, "--delta", "maybe"], "invalid choice: 'maybe'"),
    (["demo", "--steps", "3"], "--steps: only with --source megatron-core"),
    (["demo", "--lr", "1e-6", "--delta", "off"], "--lr, --delta: only with --source megatron-core"),
    (["demo", "--engine", "vllm", "--delta", "auto"], "--delta: only with --source megatron-core"),
]


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_training_flags_are_one_line_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "error:" in lines[0], err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert time.monotonic() - started < 10, "something started before the input was checked"


def _recorded(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    ran: list[argparse.Namespace] = []
    module = cli._load(cli.DELEGATES["demo"])
    monkeypatch.setattr(module, "run", lambda args: ran.append(args) or 0)
    assert main(argv) == 0 and len(ran) == 1
    return ran[0]


def test_good_flags_reach_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _recorded([*MEGATRON, "--steps", "3", "--lr", "2e-6", "--delta", "off"], monkeypatch)
    assert (args.steps, args.lr, args.delta) == (3, 2e-6, "off")


def test_the_demo_fills_the_training_defaults_for_megatron_core_only() -> None:
    """Control for the refusal above: not given, they are None until the megatron-core demo
    fills them (the synthetic demo never sees a value it would ignore)."""
    from sync_runtime.demo import run as demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--source", "megatron-core"])
    demo._fill_defaults(args)
    assert (args.steps, args.lr, args.delta) == (2, 1e-6, "auto")
    synthetic = parser.parse_args([])
    demo._fill_defaults(synthetic)
    assert (synthetic.steps, synthetic.lr, synthetic.delta) == (None, None, None)
