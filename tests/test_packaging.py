"""The distribution ships every package on disk and the presets (`pip install .`, the Dockerfile, venv.sh)."""

import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def _packages_on_disk() -> set[str]:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "sync_runtime").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    found |= {
        ".".join(init.parent.relative_to(ROOT / "operator").parts)
        for init in (ROOT / "operator").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """A wheel built from this checkout, the way every install of the project builds one."""
    import shutil
    import subprocess
    import sys

    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "sync_runtime", "operator"):
        path = ROOT / name
        (shutil.copytree if path.is_dir() else shutil.copy)(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("weightsync-*.whl")
    return zipfile.ZipFile(built)


def test_wheel_ships_every_package(wheel: zipfile.ZipFile) -> None:
    shipped = {".".join(Path(n).parent.parts) for n in wheel.namelist() if n.endswith("/__init__.py")}
    assert _packages_on_disk() <= shipped
    assert "weightsync_operator" in shipped


def test_wheel_ships_the_presets(wheel: zipfile.ZipFile) -> None:
    on_disk = {p.name for p in (ROOT / "sync_runtime" / "core" / "models" / "presets").glob("*.json")}
    shipped = {Path(n).name for n in wheel.namelist() if "/presets/" in n and n.endswith(".json")}
    assert on_disk and on_disk == shipped


def test_package_dir_maps_the_operator() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["weightsync_operator"] == "operator/weightsync_operator"
