"""`weightsync run`: one-shot (`--config ws.yaml`) or long-lived (`--kubernetes`) coordinator."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from sync_runtime.errors import RayUnreachableError, WeightSyncError
from sync_runtime.runtime.connect import connect_ray, ensure_ray_auth_env, resolve_address
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.report import ProgressEvent, SyncReport, SyncResult

log = logging.getLogger("weightsync.run")
HEARTBEAT_S = 30.0


class JsonReporter:
    """Progress as JSON lines on stderr; the final report to a file or stdout."""

    def __init__(self, report_path: str | None, quiet: bool = False) -> None:
        self.report_path = report_path
        self.quiet = quiet
        self.reports: list[SyncReport] = []

    def progress(self, event: ProgressEvent) -> None:
        if not self.quiet:
            print(event.model_dump_json(by_alias=True), file=sys.stderr, flush=True)

    def finished(self, report: SyncReport) -> None:
        self.reports.append(report)
        text = report.model_dump_json(by_alias=True, indent=2)
        if self.report_path:
            with open(self.report_path, "w") as f:
                f.write(text + "\n")
        else:
            print(text, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a WeightSync manifest (YAML/JSON, the CR's schema): one-shot sync")
    parser.add_argument("--kubernetes", action="store_true", help="long-lived: watch the WeightSync CR")
    parser.add_argument("--namespace", default=os.environ.get("WEIGHTSYNC_NAMESPACE"), help="CR namespace")
    parser.add_argument("--name", default=os.environ.get("WEIGHTSYNC_NAME"), help="CR name")
    parser.add_argument("--report", help="write the report JSON here (default: stdout)")
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="address participants use to reach this process (default: $POD_IP, else the Ray node IP)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def load_spec_file(path: str) -> WeightSyncSpec:
    """A WeightSync manifest file: a full CR (`spec:` inside) or just the spec."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(doc).__name__}")
    return WeightSyncSpec.model_validate(doc.get("spec", doc))


def run(args: argparse.Namespace) -> int:
    ensure_ray_auth_env(sys.argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.kubernetes:
        if not (args.namespace and args.name):
            print("weightsync run --kubernetes needs --namespace and --name", file=sys.stderr)
            return 2
        return serve_kubernetes(args.namespace, args.name, args.advertise_host)
    if not args.config:
        print("weightsync run needs --config FILE or --kubernetes", file=sys.stderr)
        return 2
    try:
        spec = load_spec_file(args.config)
        connect_ray(spec, args.namespace)
    except (OSError, ValueError, WeightSyncError) as e:  # a missing file, a bad manifest, no Ray
        print(f"weightsync run: {e}", file=sys.stderr)
        return 1
    reporter = JsonReporter(args.report, quiet=args.quiet)
    coordinator = Coordinator(spec, reporter, advertise_host=args.advertise_host)
    try:
        report = coordinator.sync(spec.version)
    finally:
        coordinator.close()
    return 0 if report.result is SyncResult.SUCCEEDED else 1


def serve_kubernetes(namespace: str, name: str, advertise_host: str | None) -> int:
    """The runtime pod's loop: one sync per new desired spec, reported through status.runtime.

    A spec whose version every destination already holds is reported Synced without moving
    bytes (a restarted runtime); a topology change is noticed by discovery and rebuilds the
    plan and the process group; a new Ray address reconnects the driver.
    """
    from sync_runtime.kube.status import KubernetesReporter, watch_desired

    reporter = KubernetesReporter(namespace, name)
    stop = threading.Event()
    threading.Thread(
        target=_heartbeat, args=(reporter, stop), name="weightsync-heartbeat", daemon=True
    ).start()
    coordinator: Coordinator | None = None
    address: str | None = None
    try:
        for spec in watch_desired(namespace, name):
            if coordinator is None or resolve_address(spec, namespace) != address:
                if coordinator is not None:
                    coordinator.close()
                address = _connect_until_up(spec, namespace, reporter)
                coordinator = Coordinator(spec, reporter, advertise_host=advertise_host)
            coordinator.update_spec(spec)
            _sync_with_retries(coordinator, spec)
    finally:
        stop.set()
        if coordinator is not None:
            coordinator.close()
    return 0


def _heartbeat(reporter, stop: threading.Event) -> None:
    """The operator tells a live idle runtime from a dead one by status.runtime.heartbeatTime."""
    while not stop.wait(HEARTBEAT_S):
        reporter.heartbeat()


def _connect_until_up(spec: WeightSyncSpec, namespace: str, reporter) -> str:
    """Connect (switching clusters if the address changed), retrying with backoff while reporting Failed."""
    import ray

    from sync_runtime.schema.status import RuntimePhase

    if ray.is_initialized():
        ray.shutdown()
    delay = max(1.0, float(spec.retry.backoff_seconds))
    while True:
        reporter.set_phase(RuntimePhase.CONNECTING, version=spec.version)
        try:
            address = connect_ray(spec, namespace)
        except RayUnreachableError as e:
            reporter.set_phase(RuntimePhase.FAILED, reason=e.reason.value, message=e.message[:1000])
            log.warning("%s; retrying in %.0fs", e, delay)
            time.sleep(delay)
            delay = min(delay * 2, max(1.0, float(spec.retry.max_backoff_seconds)))
            continue
        reporter.set_phase(RuntimePhase.IDLE, version=spec.version)
        return address


def _sync_with_retries(coordinator: Coordinator, spec: WeightSyncSpec) -> None:
    """spec.retry: a failed sync of the same version is retried `limit` times with backoff."""
    delay = float(spec.retry.backoff_seconds)
    for attempt in range(spec.retry.limit + 1):
        report = coordinator.sync(spec.version, skip_if_current=True)
        log.info("sync %s attempt %d: %s", report.version, attempt + 1, report.result.value)
        if report.result is SyncResult.SUCCEEDED or report.failure is None:
            return
        if not report.failure.retryable:
            return  # only a change of the spec or the deployments can fix it (a new spec is watched)
        time.sleep(delay)
        delay = min(delay * 2, float(spec.retry.max_backoff_seconds))
