"""The bad-manifest table, checked offline: each case is refused with its expected text.

Schema and strict cases go through the CRD's openAPIV3Schema (tests/bad_manifests/offline.py);
CEL cases through sync_runtime.schema.crd.spec_problems, which mirrors the CEL rules message for
message; transition and condition cases through the same logic the CRD rule / operator uses.
The authoritative run (real kube-apiserver, kubectl) is in the e2e suite.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from bad_manifests.cases import BadManifest, load_cases, merge_patch
from bad_manifests.offline import apply_defaults, schema_errors
from weightsync_operator.pod import PodPhase, PodState
from weightsync_operator.retry import PodAction, PodDecision
from weightsync_operator.status import derive_status

from sync_runtime.schema.crd import WeightSyncSpec, spec_problems
from sync_runtime.schema.status import RestartStatus, RuntimeStatus, WeightSyncStatus

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "crds" / "weightsyncs.weightsync.io.yaml").read_text())["spec"]["versions"][
    0
]["schema"]["openAPIV3Schema"]
CASES = load_cases()
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def offline_rejection(manifest: dict) -> list[str]:
    """What the API server would say: schema first; CEL only when the schema passes (as the server does)."""
    errors = schema_errors(SCHEMA, manifest)
    if errors:
        return errors
    spec = WeightSyncSpec.model_validate(apply_defaults(SCHEMA, manifest)["spec"])
    # spec_problems says "path: message"; the API server says "path: Invalid value: message".
    return [p.replace(": ", ": Invalid value: ", 1) for p in spec_problems(spec)]


def transition_rejection(old: dict, status: dict, new: dict) -> list[str]:
    rule = SCHEMA["x-kubernetes-validations"][0]
    if status.get("phase") == "Syncing" and any(
        old["spec"][k] != new["spec"][k] for k in ("source", "destinations")
    ):
        return [f"spec: Forbidden: {rule['message']}"]
    return []


def test_table_is_big_enough_and_names_are_unique() -> None:
    rejected = [c for c in CASES if c.stage != "condition"]
    assert len(rejected) >= 15
    assert len({c.name for c in CASES}) == len(CASES)
    assert {c.stage for c in CASES} == {"schema", "strict", "cel", "transition", "condition"}


def test_base_manifest_is_valid() -> None:
    assert offline_rejection(CASES[0].base) == []


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.stage in ("schema", "strict", "cel")], ids=lambda c: c.name
)
def test_case_is_refused_with_expected_text(case: BadManifest) -> None:
    errors = offline_rejection(case.manifest)
    text = "\n".join(errors)
    assert errors, f"{case.name}: accepted"
    for expected in case.expect:
        assert expected in text, f"{case.name}: {expected!r} not in {text!r}"
    # The stage is right: schema/strict cases fail the schema, CEL cases pass it.
    assert bool(schema_errors(SCHEMA, case.manifest)) == (case.stage != "cel")


@pytest.mark.parametrize("case", [c for c in CASES if c.stage == "transition"], ids=lambda c: c.name)
def test_transition_case(case: BadManifest) -> None:
    assert offline_rejection(case.manifest) == []  # valid on its own: only the transition is refused
    errors = transition_rejection(case.base, case.status or {}, case.manifest)
    assert errors and all(e in errors[0] for e in case.expect)
    assert transition_rejection(case.base, {"phase": "Synced"}, case.manifest) == []


def _condition(status: WeightSyncStatus, type_: str) -> tuple[str, str]:
    c = status.condition(type_)
    assert c is not None
    return c.status, c.reason


def test_condition_cases_end_in_the_expected_condition() -> None:
    cases = {c.name: c for c in CASES if c.stage == "condition"}
    for case in cases.values():
        assert offline_rejection(case.manifest) == [], case.name  # the API server accepts them
    none = PodDecision(PodAction.NONE, RestartStatus())
    spec = WeightSyncSpec.model_validate(cases["missing-auth-secret"].manifest["spec"])
    pod = PodState(
        phase=PodPhase.PENDING,
        name="p",
        uid="u",
        waiting_reason="CreateContainerConfigError",
        message='secret "does-not-exist" not found',
    )
    status, _ = derive_status(spec, 1, pod, None, WeightSyncStatus(), NOW, decision=none)
    want = cases["missing-auth-secret"].expect_condition
    assert _condition(status, want["type"]) == (want["status"], want["reason"])

    spec = WeightSyncSpec.model_validate(cases["ray-cluster-missing"].manifest["spec"])
    running = PodState(phase=PodPhase.RUNNING, name="p", uid="u")
    runtime = RuntimeStatus(
        phase="Failed", pod_uid="u", reason="RayClusterUnreachable", message="no such cluster"
    )
    status, _ = derive_status(spec, 1, running, runtime, WeightSyncStatus(), NOW, decision=none)
    want = cases["ray-cluster-missing"].expect_condition
    assert _condition(status, want["type"])[0] == want["status"]


def test_merge_patch_semantics() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "d": 3}}) == {"a": {"c": 2, "d": 3}}
    assert merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
