"""Every command in README.md and docs/*.md runs as written, or is checked as far as this machine
allows; the table below says how each is checked and must list exactly the commands the text has.

- `run`: executed in-process through `weightsync`'s `main`, exit code as documented.
- `checked`: a `weightsync demo`/`run` whose module's `run` is replaced by a recorder: the CLI
  parses it and plans its topology (what fails a demo early), but no Ray cluster starts here;
  tests/engines/test_doc_demos.py runs each of them as written.
- `parse`: flags parse (`run --config` needs a Ray cluster and the manifest the reader writes).
- `make`: the Makefile has the target. `cluster`: kubectl/helm against a real cluster (run by the
  e2e tests); the repository files it names exist. `shell`: a shell assignment.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sync_runtime.cli import main as cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
VENV = str(Path(sys.executable).parents[1])


def run_as_written(command: str, timeout_s: float = 800) -> subprocess.CompletedProcess[str]:
    """A documented command in bash from the checkout, with `V` set as `V=$(bash tools/venv.sh)`
    sets it (the engine tests run it; this module only parses and plans)."""
    script = f"V={shlex.quote(VENV)}; {command}"
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

HOW: dict[str, tuple[str, int]] = {
    "make demo": ("make", 0),
    "make test": ("make", 0),
    "make bench-k8s": ("make", 0),
    # run as written (through the CLI) by tests/engines/test_vllm_server_demo.py
    'make demo ARGS="--engine vllm-server --dump /tmp/ws-serve"': ("make", 0),
    "V=$(bash tools/venv.sh)": ("shell", 0),
    "V=$(bash tools/venv.sh); PYTHONPATH=. $V/bin/python examples/rl_loop.py --steps 3": ("shell", 0),
    "VE=$(bash tools/vllm_env.sh); $VE/bin/python examples/megatron_to_vllm.py": ("shell", 0),
    '$V/bin/weightsync demo --model tiny-deepseek-v3 --src "tp=2,pp=2,layers=2+1" --dst "tp=2,replicas=2" '
    "--dump /tmp/ws-dump": ("checked", 0),
    "$V/bin/weightsync demo --source megatron-core": ("checked", 0),
    '$V/bin/weightsync demo --source megatron-core --model tiny-qwen3 --src tp=2 --dst "tp=1,replicas=2" '
    "--steps 3 --lr 1e-6 --delta auto --dump /tmp/ws-megatron": ("checked", 0),
    '$V/bin/weightsync plan --model kimi-k2 --src "tp=8,pp=8,dp=4,ep=32,layers=8+8+8+8+8+7+7+7" '
    '--dst "tp=16,ep=16,replicas=8" --json': ("run", 0),
    '$V/bin/weightsync plan --model tiny-qwen3-moe --src "tp=2,pp=2,ep=2" --dst "tp=2,ep=2,replicas=2" '
    "--plot /tmp/plan.png": ("run", 0),
    '$V/bin/weightsync simulate --model tiny-qwen3-moe --src "tp=2,pp=2" --dst "tp=2,replicas=2"': ("run", 0),
    "$V/bin/weightsync run --config ws.yaml --report report.json": ("parse", 0),
}
"""Commands not listed here (kubectl, helm) are `cluster` commands."""


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every line of a bash block, continuation lines joined, comments cut."""
    found = []
    for path in DOCS:
        text = re.sub(r"\\\n\s*", "", path.read_text())
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                command = _normalise(line)
                if command:
                    found.append((path.name, command))
    return found


def _normalise(line: str) -> str:
    """The line without its trailing comment, spaces collapsed, quoting kept as written."""
    return " ".join(line[: _comment_start(line)].split())


def _comment_start(line: str) -> int:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


COMMANDS = doc_commands()


def test_table_lists_exactly_the_documented_commands() -> None:
    documented = {c for _, c in COMMANDS if not c.startswith(("kubectl ", "helm "))}
    assert documented == set(HOW), f"add to HOW: {documented - set(HOW)}; gone: {set(HOW) - documented}"


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "$V/bin/weightsync", command
    return words[1:]


@pytest.mark.parametrize(("command", "how"), [(c, h) for c, h in HOW.items() if h[0] != "shell"], ids=list)
def test_documented_command(command: str, how: tuple[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    kind, code = how
    if kind == "make":
        target = command.split()[1]
        assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), flags=re.M), target
    elif kind == "run":
        assert cli.main(_argv(command)) == code
    elif kind == "checked":
        argv = _argv(command)
        ran: list[object] = []
        module = cli._load(cli.DELEGATES[argv[0]])
        monkeypatch.setattr(module, "run", lambda args: ran.append(args) or 0)
        assert cli.main(argv) == code and len(ran) == 1
    else:
        argv = _argv(command)
        cli.build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("command", [c for _, c in COMMANDS if c.startswith(("kubectl ", "helm "))])
def test_cluster_commands_name_files_that_exist(command: str) -> None:
    for word in shlex.split(command):
        if re.match(r"^(examples|charts|crds)/", word):
            assert (ROOT / word).exists(), word


def test_shell_lines_run_what_exists() -> None:
    assert (ROOT / "tools" / "venv.sh").exists() and (ROOT / "examples" / "rl_loop.py").exists()
    # run by tests/engines/test_vllm_examples.py in the engine environment
    assert (ROOT / "tools" / "vllm_env.sh").exists() and (ROOT / "examples" / "megatron_to_vllm.py").exists()
