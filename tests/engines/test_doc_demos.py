"""The demos README.md and docs/ show run as written: each `checked` command of
tests/test_doc_commands.py (there only parsed and planned, with Ray stubbed) runs here for real,
in a shell with `V` set to the project's venv as `V=$(bash tools/venv.sh)` sets it, and must exit
with its documented code; a command with `--dump DIR` must leave the dump's report there.

Negative control: the same shell runs a demo the CLI refuses (an unknown model) and must see
exit 2 with one line, so a shell that swallowed exit codes would fail this test.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests import test_demo_megatron_steps
from tests.test_doc_commands import HOW, run_as_written

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]  # two of the demos train real Megatron-Core

RUN_ELSEWHERE = {test_demo_megatron_steps.DOCUMENTED}
"""Documented demos another module runs as written (and checks more closely): not run twice."""
DEMOS = [
    (command, code)
    for command, (kind, code) in HOW.items()
    if kind == "checked" and command not in RUN_ELSEWHERE
]


def test_every_documented_demo_is_covered() -> None:
    assert len(DEMOS) >= 2, DEMOS
    for command in RUN_ELSEWHERE:
        assert HOW.get(command) == ("checked", 0), command  # still in the docs, as written


@pytest.mark.parametrize(("command", "code"), DEMOS, ids=[c for c, _ in DEMOS])
def test_documented_demo_runs_as_written(command: str, code: int) -> None:
    words = shlex.split(command)
    dump = Path(words[words.index("--dump") + 1]) if "--dump" in words else None
    if dump is not None:
        subprocess.run(["rm", "-rf", str(dump)], check=True)
    done = run_as_written(command)
    assert done.returncode == code, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if dump is not None:
        assert (dump / "report.json").is_file(), sorted(p.name for p in dump.iterdir())


def test_control_a_refused_demo_exits_2_with_one_line() -> None:
    done = run_as_written("$V/bin/weightsync demo --model no-such-model")
    assert done.returncode == 2, done
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
