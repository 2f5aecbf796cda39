"""The trainer's push through Kubernetes (`sync_runtime.trainer.KubernetesSync`) against the real
API server.

First part, the watch logic: a WeightSync in a namespace no operator watches, and a scripted
"operator" thread writing the status the real one would (with the shared status models), so
every branch is exact and fast: success returns the report, a stale Synced condition is not
taken for ours, a failure raises its typed error, a newer version from another writer, a
deletion, a missing WeightSync, a timeout.

Second part, everything real (Helm-installed operator, runtime pod, the demo's actors in a
token-authenticated Ray cluster): pushes return the runtime's report; the overhead of the
Kubernetes path (patch -> Synced, minus the runtime's own sync seconds) is measured over five
pushes and recorded (`record_property` and stderr), bounded only for sanity; a destination
killed between pushes makes the next push raise the runtime's typed error with its reason.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import free_port
from helpers import condition, get_json, wait_for
from ray_cluster import RayCluster

from sync_runtime.errors import ParticipantDied, Reason, SyncStep, TopologyMismatchError, WeightSyncError
from sync_runtime.schema.report import SyncFailure, SyncReport, SyncResult
from sync_runtime.schema.status import Condition, LastSync, Phase, RuntimeStatus, WeightSyncStatus
from sync_runtime.trainer import KubernetesSync, PushTimeout, VersionSuperseded, WeightSyncNotFound

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "weightsyncs.weightsync.io.yaml"
GROUP, VERSION, PLURAL = "weightsync.io", "v1alpha1", "weightsyncs"


def weightsync(name: str, version: str = "v0", retry_limit: int = 0) -> dict[str, Any]:
    ref = {"rayAddress": "127.0.0.1:1", "layout": "hf"}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightSync",
        "metadata": {"name": name},
        "spec": {
            "version": version,
            "allowUnauthenticatedRay": True,
            "source": {"name": "trainer", "actorPrefix": "t-", **ref},
            "destinations": [{"name": "rollout", "actorPrefix": "v-", **ref}],
            "retry": {"limit": retry_limit, "backoffSeconds": 1, "maxBackoffSeconds": 1},
        },
    }


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def report(version: str, failure: SyncFailure | None = None, seconds: float = 1.25) -> SyncReport:
    end = _now()
    return SyncReport(
        version=version,
        started_at=end - timedelta(seconds=2),
        finished_at=end,
        result=SyncResult.FAILED if failure else SyncResult.SUCCEEDED,
        failure=failure,
        planned_bytes=1000,
        moved_bytes=0 if failure else 1000,
        seconds=seconds,
    )


def operator_status(
    generation: int, desired: str, last: SyncReport | None, synced: str | None, phase: Phase
) -> dict[str, Any]:
    """What the operator derives for (desired, last report): Synced/Degraded with their reasons."""
    if synced == desired:
        cond = ("True", "VersionSynced", f"version {desired} synced")
    elif last is not None and last.version == desired and last.failure is not None:
        cond = ("False", last.failure.reason, f"sync of version {desired} failed: {last.failure.reason}")
    else:
        cond = ("False", "SyncPending", f"version {desired} not synced yet")
    degraded = ("True", "SyncFailed", cond[2]) if cond[1] not in ("VersionSynced", "SyncPending") else None
    t = _now()
    conditions = [
        Condition(type="Synced", status=cond[0], reason=cond[1], message=cond[2], last_transition_time=t)
    ]
    dstat, dreason, dmsg = degraded or ("False", "AsExpected", "")
    conditions.append(
        Condition(type="Degraded", status=dstat, reason=dreason, message=dmsg, last_transition_time=t)
    )
    conditions = [c.model_copy(update={"observed_generation": generation}) for c in conditions]
    last_sync = None
    runtime = None
    if last is not None:
        summary = last.model_dump(include=set(LastSync.model_fields) - {"failure", "stages"})
        f = last.failure
        failure = f and {
            "reason": f.reason,
            "message": f.message,
            "rank": f.rank,
            "step": f.step and f.step.value,
        }
        last_sync = LastSync.model_validate({**summary, "failure": failure})
        runtime = RuntimeStatus(
            phase="Idle", version=last.version, last_report=last.model_dump(by_alias=True, mode="json")
        )
    status = WeightSyncStatus(
        phase=phase, observed_generation=generation, conditions=conditions, synced_version=synced,
        last_sync=last_sync, runtime=runtime,
    )  # fmt: skip
    return {"status": status.model_dump(by_alias=True, mode="json", exclude_none=True)}


class Fake:
    """The WeightSync `name` in `namespace` and a stand-in operator writing its status."""

    def __init__(self, api: Any, kubectl: Any, namespace: str, name: str, **kw: Any) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(weightsync(name, **kw)))
        self.errors: list[BaseException] = []

    def get(self) -> dict[str, Any]:
        return self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)  # type: ignore[no-any-return]

    def write(self, body: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.name, body,
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    def set_version(self, version: str) -> None:
        self.api.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name, {"spec": {"version": version}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    def after_patch(self, script: Callable[[dict[str, Any]], None]) -> threading.Thread:
        """Run `script(obj)` once the generation moved (the trainer's patch landed)."""
        start = int(self.get()["metadata"]["generation"])

        def run() -> None:
            try:
                obj = wait_for(
                    "the trainer's patch",
                    lambda: (o := self.get())["metadata"]["generation"] > start and o,
                    30,
                    0.05,
                )
                script(obj)
            except BaseException as e:  # reported by the test, not lost in the thread
                self.errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


@pytest.fixture(scope="module")
def api(control_plane: Any, kubectl: Any) -> Any:
    from kubernetes import client

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/weightsyncs.weightsync.io", "--timeout=60s")
    return client.CustomObjectsApi(control_plane.api_client())


def test_push_returns_the_report_of_its_version(api: Any, kubectl: Any, namespace: str) -> None:
    ws = Fake(api, kubectl, namespace, "ok")
    ws.write(operator_status(1, "v0", report("v0"), "v0", Phase.SYNCED))

    def operator(obj: dict[str, Any]) -> None:
        gen = obj["metadata"]["generation"]
        ws.write(operator_status(gen, "v1", report("v0"), "v0", Phase.SYNCING))  # requested, not yet synced
        time.sleep(0.3)
        ws.write(operator_status(gen, "v1", report("v1", seconds=2.5), "v1", Phase.SYNCED))

    thread = ws.after_patch(operator)
    got = KubernetesSync("ok", namespace, api=api, timeout_s=30).push("v1")
    thread.join(5)
    assert not ws.errors, ws.errors
    assert got.version == "v1" and got.result is SyncResult.SUCCEEDED and got.seconds == 2.5


def test_a_synced_condition_from_before_the_patch_is_not_taken(
    api: Any, kubectl: Any, namespace: str
) -> None:
    """The stored status already claims syncedVersion=v1 Synced, but for the old generation: the
    push waits for the operator to observe its patch."""
    ws = Fake(api, kubectl, namespace, "stale")
    ws.write(operator_status(1, "v1", report("v1", seconds=9.0), "v1", Phase.SYNCED))

    def operator(obj: dict[str, Any]) -> None:
        time.sleep(1.0)
        ws.write(
            operator_status(
                obj["metadata"]["generation"], "v1", report("v1", seconds=3.0), "v1", Phase.SYNCED
            )
        )

    thread = ws.after_patch(operator)
    sync = KubernetesSync("stale", namespace, api=api, timeout_s=30)
    got = sync.push("v1")
    thread.join(5)
    assert not ws.errors, ws.errors
    assert got.seconds == 3.0, "took the Synced condition of the generation before the patch"
    assert sync.last_push_seconds is not None and sync.last_push_seconds >= 0.9


def test_a_failed_sync_raises_its_typed_error(api: Any, kubectl: Any, namespace: str) -> None:
    ws = Fake(api, kubectl, namespace, "fails")
    failure = SyncFailure(
        reason="ParticipantDied", message="actor vllm-r1 died", rank=5, step=SyncStep.TRANSFER
    )

    def operator(obj: dict[str, Any]) -> None:
        ws.write(
            operator_status(obj["metadata"]["generation"], "v1", report("v1", failure), None, Phase.FAILED)
        )

    ws.after_patch(operator)
    with pytest.raises(WeightSyncError) as caught:
        KubernetesSync("fails", namespace, api=api, timeout_s=30).push("v1")
    err = caught.value
    assert isinstance(err, ParticipantDied) and err.reason is Reason.PARTICIPANT_DIED
    assert (err.rank, err.step) == (5, SyncStep.TRANSFER)
    assert "failed: ParticipantDied" in err.message  # the Synced condition's message


def test_a_retryable_failure_waits_for_the_runtimes_retries(api: Any, kubectl: Any, namespace: str) -> None:
    """retry.limit 1: the first failed attempt is not the answer; the retry's success is."""
    ws = Fake(api, kubectl, namespace, "retry", retry_limit=1)
    failure = SyncFailure(reason="TransferTimeout", message="rank 3 waited 60s", rank=3)

    def operator(obj: dict[str, Any]) -> None:
        gen = obj["metadata"]["generation"]
        ws.write(operator_status(gen, "v1", report("v1", failure), None, Phase.FAILED))
        time.sleep(1.2)  # finishedAt has second precision: the retry's report must differ
        ws.write(operator_status(gen, "v1", report("v1"), "v1", Phase.SYNCED))

    ws.after_patch(operator)
    got = KubernetesSync("retry", namespace, api=api, timeout_s=30).push("v1")
    assert got.result is SyncResult.SUCCEEDED and not ws.errors


def test_a_newer_version_from_another_writer_supersedes(api: Any, kubectl: Any, namespace: str) -> None:
    ws = Fake(api, kubectl, namespace, "raced")

    def other_writer(obj: dict[str, Any]) -> None:
        ws.set_version("v2")  # e.g. a second trainer process
        gen = ws.get()["metadata"]["generation"]
        ws.write(operator_status(gen, "v2", None, None, Phase.SYNCING))
        ws.write(operator_status(gen, "v2", report("v2"), "v2", Phase.SYNCED))

    ws.after_patch(other_writer)
    with pytest.raises(VersionSuperseded) as caught:
        KubernetesSync("raced", namespace, api=api, timeout_s=30).push("v1")
    assert (caught.value.version, caught.value.newer) == ("v1", "v2")


def test_a_missing_or_deleted_weightsync_is_a_clear_error(api: Any, kubectl: Any, namespace: str) -> None:
    with pytest.raises(WeightSyncNotFound, match=f"{namespace}/nope does not exist"):
        KubernetesSync("nope", namespace, api=api).push("v1")
    ws = Fake(api, kubectl, namespace, "gone")
    ws.after_patch(lambda _: kubectl("delete", "weightsync", "gone", "-n", namespace, "--wait=false"))
    with pytest.raises(WeightSyncNotFound) as caught:
        KubernetesSync("gone", namespace, api=api, timeout_s=30).push("v1")
    assert caught.value.deleted


def test_no_outcome_by_the_deadline_raises_a_timeout(api: Any, kubectl: Any, namespace: str) -> None:
    ws = Fake(api, kubectl, namespace, "silent")
    ws.write(operator_status(1, "v0", report("v0"), "v0", Phase.SYNCED))
    ws.after_patch(
        lambda obj: ws.write(
            operator_status(obj["metadata"]["generation"], "v1", report("v0"), "v0", Phase.SYNCING)
        )
    )
    t0 = time.monotonic()
    with pytest.raises(PushTimeout) as caught:
        KubernetesSync("silent", namespace, api=api).push("v1", timeout_s=3)
    took = time.monotonic() - t0
    err = caught.value
    assert err.version == "v1" and err.phase == "Syncing" and err.reason == "SyncPending", err
    assert "v1" in str(err) and "Syncing" in str(err)
    assert 2.5 <= took < 20, took


# ---- everything real: the operator, its runtime pod, the demo's actors ---------------------------

CHART = REPO / "charts" / "weightsync-operator"
FULL_NS, RELEASE, WS, SECRET = "ws-trainer", "wstr", "policy", "ray-token"
RAY_NS, MODEL, SRC, DST, SEED = "e2e-trainer", "tiny-llama", "tp=2", "tp=2,replicas=2", 13
SYNC_TIMEOUT = 240.0
"""A first sync through a fresh runtime pod on a loaded 2-core machine (imports torch, joins Ray)."""
BENCH_PUSHES = int(os.environ.get("WS_PUSH_BENCH_N", "5"))
BENCH_JSON = os.environ.get("WS_PUSH_BENCH_JSON")
"""bench/k8s_push_bench.py runs the overhead test and reads its figures from this file."""


def _demo(cluster: RayCluster, *args: str) -> None:
    cluster.run(
        "weightsync", "demo", *args, "--ray-address", cluster.address, "--namespace", RAY_NS,
        "--model", MODEL, "--src", SRC, "--dst", DST, "--src-prefix", "trainer-", "--dst-prefix", "vllm-",
        "--seed", str(SEED),
    )  # fmt: skip


def _full_manifest(address: str) -> dict[str, Any]:
    def ref(name: str, prefix: str, layout: str, parallelism: dict[str, int]) -> dict[str, Any]:
        return {
            "name": name, "rayAddress": address, "rayNamespace": RAY_NS, "actorPrefix": prefix,
            "layout": layout, "parallelism": parallelism,
            "authSecretRef": {"name": SECRET, "key": "auth_token"},
        }  # fmt: skip

    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightSync",
        "metadata": {"name": WS, "namespace": FULL_NS},
        "spec": {
            "version": "v0",
            "model": MODEL,
            "source": ref("trainer", "trainer-", "megatron", {"tp": 2}),
            "destinations": [ref("rollout", "vllm-", "vllm", {"tp": 2, "replicas": 2})],
            "transport": {
                "bucketMb": 1,
                "stagingBudgetMb": 8,
                "connectTimeoutSeconds": 60,
                "transferTimeoutSeconds": 60,
            },
            "retry": {"limit": 3, "backoffSeconds": 1, "maxBackoffSeconds": 5},
        },
    }


@pytest.fixture(scope="module")
def stack(
    control_plane: Any,
    node_agent: Any,
    kubectl: Any,
    helm: Any,
    ray_cluster: RayCluster,
    tmp_path_factory: Any,
) -> Iterator[KubernetesSync]:
    """Helm release (single-namespace mode) + the demo's participants + the WeightSync at v0."""
    from kubernetes import client

    kubectl("create", "namespace", FULL_NS)
    wait_for("default ServiceAccount", lambda: get_json(kubectl, "sa", "default", "-n", FULL_NS), 30)
    kubectl(
        "create", "secret", "generic", SECRET, "-n", FULL_NS, f"--from-literal=auth_token={ray_cluster.token}"
    )
    values = {
        "watchNamespace": FULL_NS,
        "operator": {"command": ["kopf"], "healthPort": 0, "reconcileIntervalSeconds": 1},
        "bindAddress": "127.0.0.1",
        "metrics": {"port": free_port()},
    }
    path = tmp_path_factory.mktemp("helm-trainer") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        FULL_NS,
        "-f",
        str(path),
        "--wait",
        "--timeout",
        "3m",
        timeout=240,
    )
    ray_cluster.driver(
        "participants", "--namespace", RAY_NS, "--model", MODEL, "--src", SRC, "--dst", DST,
        "--src-prefix", "trainer-", "--dst-prefix", "vllm-", "--seed", str(SEED), "--version", "v1",
        "--stale-version", "v0", timeout=300,
    )  # fmt: skip
    kubectl("apply", "-f", "-", input=json.dumps(_full_manifest(ray_cluster.address)))
    try:
        yield KubernetesSync(WS, FULL_NS, api=client.CustomObjectsApi(control_plane.api_client()))
    finally:
        helm("uninstall", RELEASE, "-n", FULL_NS, "--wait", check=False, timeout=120)
        kubectl("delete", "namespace", FULL_NS, "--wait=false", check=False)
        # The participants are detached: each would hold a torch process's memory for the session.
        ray_cluster.driver("kill-all", "--namespace", RAY_NS, check=False)


def test_push_through_the_operator_returns_the_runtimes_report(
    stack: KubernetesSync, ray_cluster: RayCluster
) -> None:
    """The sources hold v1 (participants-only): the first push also waits for the runtime pod."""
    got = stack.push("v1", timeout_s=SYNC_TIMEOUT)
    assert got.version == "v1" and got.result is SyncResult.SUCCEEDED and got.moved_bytes > 0
    # status.runtime.lastReport is bounded: the per-rank table stays in the runtime's log and report
    # file; the CR carries its summary, which must still describe every rank that moved bytes.
    summary = got.rank_summary
    assert got.ranks == [] and summary is not None, "lastReport carries the rank summary, not the table"
    assert summary.count > 0 and summary.max_send_bytes > 0 and summary.max_recv_bytes > 0
    _demo(ray_cluster, "--verify-only", "--expect-version", "v1")  # exits non-zero unless bit-exact


def test_overhead_of_the_kubernetes_path(stack: KubernetesSync, record_property: Any) -> None:
    """Patch -> Synced seen by the trainer, minus the runtime's own sync seconds, median of five
    warm pushes. Recorded, not asserted beyond sanity: the figure depends on the machine's load.
    (Version labels only: the sources keep their weights; the runtime moves the same bytes.)"""
    stack.push("warm", timeout_s=SYNC_TIMEOUT)  # the runtime pod is up and the plan cached
    rows = []
    for i in range(BENCH_PUSHES):
        report = stack.push(f"bench-{i}", timeout_s=120)
        wall = stack.last_push_seconds
        assert wall is not None
        rows.append({"wall_s": wall, "runtime_s": report.seconds, "overhead_s": wall - report.seconds})
    median = statistics.median(r["overhead_s"] for r in rows)
    record_property("k8s_push_overhead_median_s", round(median, 4))
    print(f"k8s push overhead: median {median:.3f}s over {len(rows)} pushes: {rows}", file=sys.stderr)
    if BENCH_JSON:
        Path(BENCH_JSON).write_text(json.dumps({"median_overhead_s": median, "pushes": rows}, indent=2))
    assert all(r["runtime_s"] > 0 and r["wall_s"] >= r["runtime_s"] for r in rows), rows
    assert 0 < median < 60, rows


def test_a_killed_destination_makes_the_next_push_raise_the_runtimes_error(
    stack: KubernetesSync, ray_cluster: RayCluster, kubectl: Any
) -> None:
    """One destination rank is gone before the push: discovery finds 3 of 4 ranks, the runtime
    reports TopologyMismatch (not retryable), and the push raises exactly that typed error."""
    ray_cluster.driver("kill", "--namespace", RAY_NS, "--name", "vllm-r1-pp0-tp1")
    with pytest.raises(WeightSyncError) as caught:
        stack.push("after-kill", timeout_s=120)
    err = caught.value
    assert isinstance(err, TopologyMismatchError) and err.reason is Reason.TOPOLOGY_MISMATCH, err
    assert err.step is SyncStep.DISCOVER and "missing rank" in err.message
    synced = condition(get_json(kubectl, "weightsync", WS, "-n", FULL_NS), "Synced")
    assert synced is not None and synced["reason"] == err.reason.value, synced
