"""Desired runtime pod rendering and pod observation."""

from __future__ import annotations

import copy

import pytest
from weightsync_operator.config import ConfigError, OperatorConfig, RuntimeDefaults
from weightsync_operator.pod import (
    ANNOTATION_TOPOLOGY,
    MISSING,
    PodPhase,
    observe_pod,
    render_runtime_pod,
    topology_hash,
)

from sync_runtime.schema.crd import WeightSyncSpec

pytestmark = pytest.mark.unit

SPEC = {
    "version": "v1",
    "source": {
        "name": "trainer",
        "rayAddress": "ray://a:10001",
        "actorPrefix": "t-",
        "layout": "megatron",
        "authSecretRef": {"name": "src-token"},
    },
    "destinations": [
        {"name": "d0", "rayCluster": "rc", "actorPrefix": "v-", "layout": "vllm"},
        {
            "name": "d1",
            "rayCluster": "rc",
            "actorPrefix": "w-",
            "layout": "vllm",
            "authSecretRef": {"name": "dst-token", "key": "auth_token"},
        },
    ],
}
DEFAULTS = RuntimeDefaults(
    image="reg/ws:1",
    service_account_name="ws-rt",
    image_pull_secrets=("pull",),
    env=({"name": "KUBECONFIG", "value": "/k"}, {"name": "HOME", "value": "/root"}),
)


def spec(**changes: object) -> WeightSyncSpec:
    return WeightSyncSpec.model_validate({**copy.deepcopy(SPEC), **changes})


def render(s: WeightSyncSpec | None = None, defaults: RuntimeDefaults = DEFAULTS) -> dict:
    return render_runtime_pod("policy", "team", "uid-1", s or spec(), defaults)


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_identity_owner_and_labels() -> None:
    pod = render()
    meta = pod["metadata"]
    assert (meta["name"], meta["namespace"]) == ("policy-runtime", "team")
    assert meta["labels"]["app.kubernetes.io/name"] == "weightsync-runtime"
    assert meta["labels"]["weightsync.io/name"] == "policy"
    (owner,) = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSync",
        "name": "policy",
        "uid": "uid-1",
        "controller": True,
    }
    assert meta["annotations"][ANNOTATION_TOPOLOGY] == topology_hash(spec())


def test_command_is_exactly_the_runtime_entrypoint() -> None:
    container = render()["spec"]["containers"][0]
    assert container["command"] == [
        "weightsync",
        "run",
        "--kubernetes",
        "--namespace",
        "team",
        "--name",
        "policy",
    ]
    assert "args" not in container


def test_security_context_is_locked_down() -> None:
    pod = render()
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc == {
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    psc = pod["spec"]["securityContext"]
    assert (
        psc["runAsNonRoot"]
        and psc["runAsUser"] == 10001
        and psc["seccompProfile"] == {"type": "RuntimeDefault"}
    )
    assert pod["spec"]["restartPolicy"] == "Never"
    assert {"name": "tmp", "emptyDir": {}} in pod["spec"]["volumes"]
    assert {"name": "tmp", "mountPath": "/tmp"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_env_identity_and_tokens_only_by_secret_ref() -> None:
    env = env_of(render())
    assert env["WEIGHTSYNC_NAMESPACE"]["value"] == "team" and env["WEIGHTSYNC_NAME"]["value"] == "policy"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["WEIGHTSYNC_RAY_TOKEN_0"] == {
        "name": "WEIGHTSYNC_RAY_TOKEN_0",
        "valueFrom": {"secretKeyRef": {"name": "src-token", "key": "token"}},
    }
    assert env["WEIGHTSYNC_RAY_TOKEN_2"]["valueFrom"]["secretKeyRef"] == {
        "name": "dst-token",
        "key": "auth_token",
    }
    assert "WEIGHTSYNC_RAY_TOKEN_1" not in env  # d0 names no secret
    assert not any("value" in e for n, e in env.items() if n.startswith("WEIGHTSYNC_RAY_TOKEN"))


def test_user_env_cannot_override_reserved_names() -> None:
    s = spec(
        runtime={
            "env": [
                {"name": "WEIGHTSYNC_NAME", "value": "evil"},
                {"name": "WEIGHTSYNC_RAY_TOKEN_0", "value": "leak"},
                {"name": "NCCL_DEBUG", "value": "INFO"},
            ]
        }
    )
    pod = render(s)
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names))
    env = env_of(pod)
    assert env["WEIGHTSYNC_NAME"]["value"] == "policy" and env["NCCL_DEBUG"]["value"] == "INFO"
    assert env["HOME"]["value"] == "/tmp"  # the default env's HOME=/root was dropped too
    assert env["KUBECONFIG"]["value"] == "/k"
    assert "value" not in env["WEIGHTSYNC_RAY_TOKEN_0"]


def test_defaults_and_overrides() -> None:
    pod = render()
    assert (
        pod["spec"]["containers"][0]["image"] == "reg/ws:1" and pod["spec"]["serviceAccountName"] == "ws-rt"
    )
    assert pod["spec"]["imagePullSecrets"] == [{"name": "pull"}]
    assert "nodeSelector" not in pod["spec"] and "resources" not in pod["spec"]["containers"][0]
    s = spec(
        runtime={
            "image": "mine:2",
            "nodeSelector": {"pool": "a"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "resources": {"limits": {"cpu": "2"}},
        }
    )
    pod = render(s)
    assert pod["spec"]["containers"][0]["image"] == "mine:2" and pod["spec"]["serviceAccountName"] == "ws-rt"
    assert pod["spec"]["nodeSelector"] == {"pool": "a"} and pod["spec"]["tolerations"] == [
        {"key": "k", "operator": "Exists"}
    ]
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "2"}}


def test_topology_hash_ignores_version_and_retry_only() -> None:
    base = topology_hash(spec())
    assert topology_hash(spec(version="v2")) == base
    assert topology_hash(spec(retry={"limit": 9})) == base
    assert topology_hash(spec(transport={"bucketMb": 32})) != base
    assert topology_hash(spec(runtime={"image": "x"})) != base
    assert topology_hash(spec(model="tiny-llama")) != base
    changed = copy.deepcopy(SPEC["destinations"])
    changed[0]["parallelism"] = {"tp": 2}
    assert topology_hash(spec(destinations=changed)) != base


def pod_body(phase: str = "Running", **extra: object) -> dict:
    body = {
        "metadata": {"name": "policy-runtime", "uid": "u1", "annotations": {ANNOTATION_TOPOLOGY: "h"}},
        "status": {"phase": phase},
    }
    body.update(extra)
    return body


def test_observe_pod_states() -> None:
    assert observe_pod(None) is MISSING and not MISSING.exists
    running = observe_pod(pod_body())
    assert (running.phase, running.uid, running.topology_hash) == (PodPhase.RUNNING, "u1", "h")
    failed = observe_pod(
        pod_body(
            "Failed",
            status={
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "state": {
                            "terminated": {
                                "exitCode": 3,
                                "message": "boom",
                                "finishedAt": "2025-01-01T00:00:05Z",
                            }
                        }
                    }
                ],
            },
        )
    )
    assert failed.phase.ended and failed.exit_code == 3 and failed.message == "boom"
    assert failed.finished_at is not None and failed.finished_at.second == 5
    waiting = observe_pod(
        pod_body(
            "Pending",
            status={
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "state": {
                            "waiting": {"reason": "CreateContainerConfigError", "message": "secret not found"}
                        }
                    }
                ],
            },
        )
    )
    assert waiting.stuck and waiting.message == "secret not found"
    deleting = pod_body()
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert observe_pod(deleting).phase is PodPhase.TERMINATING
    assert observe_pod(pod_body("Weird")).phase is PodPhase.UNKNOWN


def test_config_from_env() -> None:
    cfg = OperatorConfig.from_env(
        {
            "WEIGHTSYNC_RUNTIME_IMAGE": "img:9",
            "WEIGHTSYNC_RUNTIME_SERVICE_ACCOUNT": "rt",
            "WEIGHTSYNC_RUNTIME_IMAGE_PULL_SECRETS": "a, b",
            "WEIGHTSYNC_RUNTIME_ENV": '[{"name": "A", "value": "1"}]',
            "WEIGHTSYNC_METRICS_PORT": "9090",
            "WEIGHTSYNC_RECONCILE_INTERVAL_SECONDS": "2.5",
            "WEIGHTSYNC_BIND_ADDRESS": "127.0.0.1",
        }
    )
    assert cfg.bind_address == "127.0.0.1" and OperatorConfig.from_env({}).bind_address == "127.0.0.1"
    assert cfg.runtime.image == "img:9" and cfg.runtime.image_pull_secrets == ("a", "b")
    assert cfg.runtime.env == ({"name": "A", "value": "1"},) and cfg.metrics_port == 9090
    assert cfg.reconcile_interval_seconds == 2.5
    assert OperatorConfig.from_env({}) == OperatorConfig()
    for bad in (
        {"WEIGHTSYNC_RUNTIME_ENV": "{"},
        {"WEIGHTSYNC_RUNTIME_ENV": '[{"value": 1}]'},
        {"WEIGHTSYNC_METRICS_PORT": "x"},
        {"WEIGHTSYNC_RECONCILE_INTERVAL_SECONDS": "0"},
    ):
        with pytest.raises(ConfigError):
            OperatorConfig.from_env(bad)
