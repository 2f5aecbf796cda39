"""The installer's allowlist: what a WeightSync author may ask of its runtime pod (operator side)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime

import pytest
from test_operator_reconcile import SPEC, FakePods, body
from weightsync_operator.config import OperatorConfig, RuntimeDefaults
from weightsync_operator.overrides import override_problems
from weightsync_operator.pod import MISSING
from weightsync_operator.reconcile import reconcile

from sync_runtime.schema.crd import WeightSyncSpec

pytestmark = pytest.mark.unit

NOW = datetime(2025, 1, 1, tzinfo=UTC)
DEFAULTS = RuntimeDefaults(image="reg/weightsync:1.0", allowed_images=("reg/weightsync-debug:*",))


def problems(runtime: dict, defaults: RuntimeDefaults = DEFAULTS) -> list[str]:
    spec = WeightSyncSpec.model_validate({**copy.deepcopy(SPEC), "runtime": runtime})
    return override_problems(spec, defaults)


def test_the_operators_image_and_allowlisted_patterns_pass() -> None:
    assert problems({}) == []
    assert problems({"image": "reg/weightsync:1.0"}) == []
    assert problems({"image": "reg/weightsync-debug:2"}) == []
    assert problems({"image": "reg/weightsync:1.0", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}) == []
    assert problems({"env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}) == []


def test_foreign_image_is_refused() -> None:
    (p,) = problems({"image": "evil.example/miner:1"})
    assert p.startswith("spec.runtime.image:") and "not in the operator's allowed runtime images" in p
    # Without an allowlist only the operator's own image runs.
    assert problems({"image": "reg/weightsync-debug:2"}, RuntimeDefaults(image="reg/weightsync:1.0"))


def test_env_sources_and_names_beyond_the_allowlist_are_refused() -> None:
    cm = {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "k"}}}
    assert "valueFrom.configMapKeyRef is not allowed" in problems({"env": [cm]})[0]
    opened = RuntimeDefaults(image="i", allowed_env_sources=("fieldRef", "configMapKeyRef"))
    assert problems({"env": [cm]}, opened) == []
    for name in ("KUBERNETES_SERVICE_HOST", "LD_PRELOAD", "PYTHONPATH", "WEIGHTSYNC_RAY_TOKEN_0"):
        (p,) = problems({"env": [{"name": name, "value": "x"}]})
        assert f"env name {name!r} is reserved" in p
    assert "names no source" in problems({"env": [{"name": "E", "valueFrom": {}}]})[0]


def test_config_reads_the_allowlist_from_the_chart_env() -> None:
    cfg = OperatorConfig.from_env(
        {
            "WEIGHTSYNC_RUNTIME_ALLOWED_IMAGES": "a:1, b/*",
            "WEIGHTSYNC_RUNTIME_ALLOWED_ENV_SOURCES": "",
            "WEIGHTSYNC_RUNTIME_DENIED_ENV_PREFIXES": "X_",
        }
    )
    assert cfg.runtime.allowed_images == ("a:1", "b/*") and cfg.runtime.allowed_env_sources == ()
    assert cfg.runtime.denied_env_prefixes == ("X_",)
    assert OperatorConfig.from_env({}).runtime.allowed_env_sources == ("fieldRef", "resourceFieldRef")


def test_refused_override_creates_nothing_and_says_why() -> None:
    api = FakePods()
    spec = {**copy.deepcopy(SPEC), "runtime": {"image": "evil.example/miner:1"}}
    result = reconcile(body(spec), MISSING, api, OperatorConfig(runtime=DEFAULTS), NOW)
    assert api.created == [] and api.deleted == []
    conds = {c["type"]: c for c in result.status_patch["conditions"]}
    for kind, status in (("RuntimeReady", "False"), ("Degraded", "True")):
        assert conds[kind]["status"] == status and conds[kind]["reason"] == "RuntimeOverrideRefused"
    assert "evil.example/miner:1" in conds["Degraded"]["message"]
    assert result.status_patch["phase"] == "Failed"


def test_unauthenticated_ray_posts_a_warning_event() -> None:
    spec = copy.deepcopy(SPEC)
    del spec["destinations"][0]["authSecretRef"]
    result = reconcile(body(spec), MISSING, FakePods(), OperatorConfig(), NOW)
    assert result.status_patch["conditions"][0]["reason"] == "InvalidSpec"  # CEL's mirror refuses it
    spec["allowUnauthenticatedRay"] = True
    api = FakePods()
    result = reconcile(body(spec), MISSING, api, OperatorConfig(), NOW)
    (warning,) = [e for e in result.events if e.reason == "UnauthenticatedRay"]
    assert warning.type == "Warning" and "d connect(s) without a Ray token" in warning.message
    assert len(api.created) == 1
