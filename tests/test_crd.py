"""The CRD file and the typed models must agree: names, defaults, CEL messages, status shape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.schema import crd
from sync_runtime.schema import status as wstatus
from sync_runtime.schema.crd import (
    DeploymentRef,
    WeightSyncSpec,
    ray_token_env_name,
    resolve_ray_address,
    spec_problems,
)
from sync_runtime.schema.status import Condition, RuntimeStatus, WeightSyncStatus

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "weightsyncs.weightsync.io.yaml"


@pytest.fixture(scope="module")
def crd_doc() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture(scope="module")
def schema(crd_doc: dict) -> dict:
    return crd_doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def full_spec() -> dict:
    """Every spec field set, camelCase, as a user would write it."""
    dep = {
        "name": "trainer",
        "rayAddress": "ray://head:10001",
        "rayNamespace": "rl",
        "actorPrefix": "t-",
        "layout": "megatron",
        "parallelism": {
            "tp": 4,
            "pp": 2,
            "dp": 2,
            "cp": 2,
            "ep": 4,
            "etp": 2,
            "vpp": 2,
            "replicas": 1,
            "layerCounts": [5, 3],
        },
        "authSecretRef": {"name": "ray-token", "key": "auth"},
    }
    dest = {
        "name": "rollout",
        "rayCluster": "rl",
        "actorPrefix": "v-",
        "layout": "vllm",
        "parallelism": {"tp": 2, "ep": 2, "replicas": 3},
        "authSecretRef": {"name": "ray-token"},
    }
    return {
        "source": dep,
        "destinations": [dest],
        "version": "step-42",
        "model": "tiny-llama",
        "transport": {
            "backend": "nccl",
            "bucketMb": 128,
            "stagingBudgetMb": 1024,
            "maxFanIn": 8,
            "relay": "auto",
            "connectTimeoutSeconds": 30,
            "transferTimeoutSeconds": 60,
            "staging": "device",
            "snapshot": True,
            "delta": "off",
        },
        "retry": {"limit": 5, "backoffSeconds": 2, "maxBackoffSeconds": 60},
        "runtime": {
            "image": "img:1",
            "resources": {"limits": {"cpu": "2", "memory": "4Gi"}},
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "env": [{"name": "X", "value": "1"}],
        },
    }


def test_every_field_parses_from_camel_case() -> None:
    spec = WeightSyncSpec.model_validate(full_spec())
    src = spec.source
    assert (src.ray_address, src.ray_namespace, src.actor_prefix) == ("ray://head:10001", "rl", "t-")
    assert src.parallelism.layer_counts == [5, 3] and src.parallelism.etp == 2 and src.parallelism.vpp == 2
    assert src.parallelism.cp == 2 and src.parallelism.to_spec().cp == 2
    assert src.auth_secret_ref is not None and src.auth_secret_ref.key == "auth"
    assert spec.destinations[0].ray_cluster == "rl" and spec.destinations[0].parallelism.replicas == 3
    t = spec.transport
    assert (t.backend, t.bucket_mb, t.staging_budget_mb, t.max_fan_in, t.relay) == (
        "nccl",
        128,
        1024,
        8,
        "auto",
    )
    assert (t.connect_timeout_seconds, t.transfer_timeout_seconds) == (30, 60)
    assert (t.staging, t.snapshot, t.delta) == ("device", True, "off")
    assert (spec.retry.limit, spec.retry.backoff_seconds, spec.retry.max_backoff_seconds) == (5, 2, 60)
    rt = spec.runtime
    assert rt.node_selector == {"pool": "cpu"} and rt.image == "img:1"
    assert spec_problems(spec) == []
    # Round trip: dumping by alias gives back what was written (where nothing was defaulted).
    dumped, written = spec.model_dump(by_alias=True, exclude_none=True), full_spec()
    for key in ("source", "transport", "retry", "runtime", "version", "model"):
        assert dumped[key] == written[key], key


def test_defaults_match_the_crd_defaults(schema: dict) -> None:
    spec = WeightSyncSpec.model_validate(
        {
            "source": {"name": "s", "rayAddress": "a", "actorPrefix": "p", "layout": "hf"},
            "destinations": [{"name": "d", "rayAddress": "a", "actorPrefix": "q", "layout": "vllm"}],
            "version": "v1",
        }
    )
    props = schema["properties"]["spec"]["properties"]
    for section, model in (("transport", spec.transport), ("retry", spec.retry)):
        for key, sub in props[section]["properties"].items():
            assert model.model_dump(by_alias=True)[key] == sub["default"], (section, key)
    par = props["source"]["properties"]["parallelism"]["properties"]
    dumped = spec.source.parallelism.model_dump(by_alias=True)
    assert all(dumped[k] == par[k]["default"] for k in par if "default" in par[k])
    assert spec.source.ray_namespace == props["source"]["properties"]["rayNamespace"]["default"]
    assert spec.source.auth_secret_ref is None and spec.model is None


def test_snake_case_also_accepted_and_unknown_fields_refused() -> None:
    ref = DeploymentRef(name="s", ray_address="a", actor_prefix="p", layout="hf")
    assert ref.model_dump(by_alias=True)["actorPrefix"] == "p"
    with pytest.raises(ValidationError, match="bucketSize"):
        WeightSyncSpec.model_validate({**full_spec(), "transport": {"bucketSize": 1}})
    with pytest.raises(ValidationError, match="staging"):
        WeightSyncSpec.model_validate({**full_spec(), "transport": {"staging": "gpu"}})
    with pytest.raises(ValidationError):
        WeightSyncSpec.model_validate({**full_spec(), "destinations": []})


def _walk_names(schema: dict, path: str = "") -> set[str]:
    out = set()
    for key, sub in (schema.get("properties") or {}).items():
        out.add(f"{path}.{key}")
        out |= _walk_names(sub.get("items", sub), f"{path}.{key}")
    return out


def _model_names(model: type, path: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        alias = field.alias or name
        out.add(f"{path}.{alias}")
        ann = field.annotation
        for candidate in getattr(ann, "__args__", (ann,)):
            inner = (
                getattr(candidate, "__args__", (candidate,))[0]
                if hasattr(candidate, "__origin__")
                else candidate
            )
            if isinstance(inner, type) and issubclass(inner, crd.BaseModel) and inner is not type(None):
                out |= _model_names(inner, f"{path}.{alias}")
    return out


def test_spec_schema_and_model_name_the_same_fields(schema: dict) -> None:
    spec_schema = schema["properties"]["spec"]
    in_schema = {
        n
        for n in _walk_names(spec_schema)
        if not n.startswith((".runtime.resources.", ".runtime.tolerations.", ".runtime.env."))
    }
    in_model = _model_names(WeightSyncSpec)
    assert in_schema == in_model


def test_status_schema_covers_the_status_models(schema: dict) -> None:
    status_schema = schema["properties"]["status"]
    in_schema = _walk_names(status_schema)
    in_model = {n for n in _model_names(WeightSyncStatus) if not n.startswith(".runtime.lastReport.")}
    assert in_model - in_schema == set()
    cond = status_schema["properties"]["conditions"]
    assert cond["x-kubernetes-list-type"] == "map" and cond["x-kubernetes-list-map-keys"] == ["type"]
    assert set(cond["items"]["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert set(cond["items"]["properties"]) == set(Condition.model_fields) - {
        "last_transition_time",
        "observed_generation",
    } | {"lastTransitionTime", "observedGeneration"}
    runtime_phase = status_schema["properties"]["runtime"]["properties"]["phase"]["enum"]
    assert runtime_phase == [p.value for p in wstatus.RuntimePhase]
    assert status_schema["properties"]["phase"]["enum"] == [p.value for p in wstatus.Phase]


def test_crd_identity_and_columns(crd_doc: dict) -> None:
    spec = crd_doc["spec"]
    assert crd_doc["metadata"]["name"] == f"{crd.PLURAL}.{crd.GROUP}"
    assert (spec["group"], spec["names"]["kind"], spec["scope"]) == (crd.GROUP, crd.KIND, "Namespaced")
    assert spec["names"]["shortNames"] == [crd.SHORT_NAME]
    version = spec["versions"][0]
    assert version["name"] == crd.VERSION and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Source": ".spec.source.name",
        "Destinations": ".status.destinations",
        "Desired": ".spec.version",
        "Serving": ".status.serving",
        "Synced": ".status.syncedVersion",
        "Phase": ".status.phase",
        "Duration": ".status.lastSync.seconds",
        "Age": ".metadata.creationTimestamp",
    }


def _rules(node: object) -> list[dict]:
    found = []
    if isinstance(node, dict):
        found += node.get("x-kubernetes-validations", [])
        for value in node.values():
            found += _rules(value)
    elif isinstance(node, list):
        for value in node:
            found += _rules(value)
    return found


def test_every_cel_message_is_mirrored_by_spec_problems(schema: dict) -> None:
    crd_messages = {r["message"] for r in _rules(schema["properties"]["spec"])}
    py_messages = {v for k, v in vars(crd).items() if k.startswith("MSG_") and k != "MSG_VERSION"}
    assert crd_messages == py_messages
    assert schema["properties"]["spec"]["properties"]["version"]["pattern"] == crd.VERSION_PATTERN
    for rule in _rules(schema):
        assert rule["rule"].strip() and rule["message"].strip()


def test_topology_transition_rule_present(schema: dict) -> None:
    (rule,) = schema["x-kubernetes-validations"]
    assert "oldSelf.status.phase != 'Syncing'" in rule["rule"] and rule["fieldPath"] == ".spec"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"destinations": [{"name": "a", "rayAddress": "x", "actorPrefix": "p", "layout": "vllm"}] * 2},
            crd.MSG_UNIQUE_DESTINATIONS,
        ),
        (
            {"destinations": [{"name": "a", "rayAddress": "x", "actorPrefix": "p", "layout": "vllm"}]},
            crd.MSG_RAY_AUTH,
        ),
        ({"transport": {"bucketMb": 300, "stagingBudgetMb": 512}}, crd.MSG_BUCKET),
        ({"retry": {"backoffSeconds": 10, "maxBackoffSeconds": 5}}, crd.MSG_BACKOFF),
        ({"version": "bad version"}, crd.MSG_VERSION),
    ],
)
def test_spec_problems_names_the_rule(change: dict, message: str) -> None:
    spec = WeightSyncSpec.model_validate({**full_spec(), **change})
    problems = spec_problems(spec)
    assert any(message in p for p in problems), problems


def test_version_pattern_edges() -> None:
    ok = ["v1", "1", "step-100", "a.b_c-d", "x" * 63]
    bad = ["", "-v1", ".v", "v 1", "v/1", "x" * 64, "é"]
    assert all(re.fullmatch(crd.VERSION_PATTERN, v) for v in ok)
    assert not any(re.fullmatch(crd.VERSION_PATTERN, v) for v in bad)


def test_ray_token_env_names_follow_deployment_order() -> None:
    spec = WeightSyncSpec.model_validate(full_spec())
    assert [d.name for d in spec.deployments()] == ["trainer", "rollout"]
    assert (
        ray_token_env_name(0) == "WEIGHTSYNC_RAY_TOKEN_0"
        and ray_token_env_name(2) == "WEIGHTSYNC_RAY_TOKEN_2"
    )
    with pytest.raises(ValueError):
        ray_token_env_name(-1)


def test_resolve_ray_address() -> None:
    spec = WeightSyncSpec.model_validate(full_spec())
    assert resolve_ray_address(spec.source, "ns") == "ray://head:10001"
    head = {"spec": {}, "status": {"head": {"podIP": "10.0.0.7"}}}
    seen: list[tuple[str, str]] = []

    def read(namespace: str, name: str) -> dict:
        seen.append((namespace, name))
        return head

    assert resolve_ray_address(spec.destinations[0], "team", read) == "10.0.0.7:6379"
    assert seen == [("team", "rl")]
    with pytest.raises(ValueError, match="exactly one"):
        resolve_ray_address(DeploymentRef(name="n", actor_prefix="p", layout="hf"), "ns")


def test_status_parses_api_output_and_tolerates_new_fields() -> None:
    raw = {
        "phase": "Synced",
        "observedGeneration": 3,
        "syncedVersion": "v2",
        "futureField": 1,
        "conditions": [
            {
                "type": "Synced",
                "status": "True",
                "reason": "VersionSynced",
                "message": "",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
                "observedGeneration": 3,
            }
        ],
        "runtime": {
            "phase": "Idle",
            "podUid": "u1",
            "heartbeatTime": "2025-01-01T00:00:01Z",
            "lastReport": {"version": "v2", "anything": True},
        },
    }
    status = WeightSyncStatus.model_validate(raw)
    assert status.phase is wstatus.Phase.SYNCED and status.condition("Synced").reason == "VersionSynced"
    assert isinstance(status.runtime, RuntimeStatus) and status.runtime.last_report == {
        "version": "v2",
        "anything": True,
    }
    assert status.restarts.count == 0 and status.condition("Degraded") is None


def test_parallelism_round_trips_through_parallel_spec() -> None:
    spec = ParallelSpec(tp=4, pp=3, dp=2, ep=8, etp=1, vpp=1, layer_counts=(3, 3, 2))
    par = crd.Parallelism.from_spec(spec)
    assert par.layer_counts == [3, 3, 2] and par.ep == 8
    assert par.to_spec() == spec
    replicated = ParallelSpec(tp=2, replicas=3)
    assert crd.Parallelism.from_spec(replicated).to_spec() == replicated
