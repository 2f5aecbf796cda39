"""Loader of the bad-manifest table (cases.yaml) for the offline CRD test and the e2e suite.

from tests.bad_manifests.cases import load_cases
for case in load_cases():
    case.manifest   # the full WeightSync to apply (metadata.name = "bad-<case name>")
    case.expect     # substrings the API server's error must contain
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TABLE = Path(__file__).with_name("cases.yaml")
STAGES = ("schema", "strict", "cel", "transition", "condition")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


@dataclass(frozen=True)
class BadManifest:
    name: str
    stage: str
    manifest: dict[str, Any]
    expect: tuple[str, ...] = ()
    base: dict[str, Any] = field(default_factory=dict)
    """The valid object the case derives from (created first for `transition` cases)."""
    status: dict[str, Any] | None = None
    """Status to set through the status subresource before a `transition` update."""
    expect_condition: dict[str, str] | None = None


def load_cases(path: Path = TABLE) -> list[BadManifest]:
    doc = yaml.safe_load(path.read_text())
    base = doc["base"]
    cases = []
    for raw in doc["cases"]:
        if raw["stage"] not in STAGES:
            raise ValueError(f"case {raw['name']}: unknown stage {raw['stage']!r}")
        named = merge_patch(base, {"metadata": {"name": f"bad-{raw['name']}"}})
        cases.append(
            BadManifest(
                name=raw["name"],
                stage=raw["stage"],
                manifest=merge_patch(named, raw["patch"]),
                expect=tuple(raw.get("expect", ())),
                base=named,
                status=raw.get("status"),
                expect_condition=raw.get("expect_condition"),
            )
        )
    return cases
