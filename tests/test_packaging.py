"""The distribution lists every package on disk, so `pip install .` (Dockerfile) ships all of them."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packages_on_disk() -> set[str]:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "sync_runtime").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    found |= {init.parent.name for init in (ROOT / "operator").glob("*/__init__.py")}
    return found


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _packages_on_disk()
    assert config["package-dir"]["weightsync_operator"] == "operator/weightsync_operator"


def test_presets_ship_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "presets/*.json" in config["package-data"]["sync_runtime"]
    assert list((ROOT / "sync_runtime" / "presets").glob("*.json"))
