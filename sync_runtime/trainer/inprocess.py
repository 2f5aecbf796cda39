"""Push in-process: the trainer's driver owns the Coordinator, no Kubernetes involved.

The driver must be connected to the participants' Ray cluster (`ray.init`, or
`sync_runtime.runtime.connect.connect_ray(spec)`); the coordinator keeps its plan and process
group between pushes, so every push after the first runs on the warm path.
"""

from __future__ import annotations

from types import TracebackType

from sync_runtime.core.manifest import Manifest
from sync_runtime.errors import WeightSyncError
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import WeightSyncSpec
from sync_runtime.schema.report import NullReporter, Reporter, SyncReport


class InProcessSync:
    """`push(version)` runs one sync of `version` and returns its report, or raises the typed
    `WeightSyncError` of its failure (`last_report` keeps the failed report too)."""

    def __init__(
        self,
        spec: WeightSyncSpec,
        *,
        reporter: Reporter | None = None,
        advertise_host: str | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        self.coordinator = Coordinator(
            spec, reporter or NullReporter(), advertise_host=advertise_host, manifest=manifest
        )
        self.last_report: SyncReport | None = None

    def push(self, version: str) -> SyncReport:
        report = self.coordinator.sync(version)
        self.last_report = report
        if report.failure is not None:
            # The coordinator never raises for sync failures; the trainer's loop wants an exception.
            raise WeightSyncError.from_failure(report.failure)
        return report

    def close(self) -> None:
        self.coordinator.close()

    def __enter__(self) -> InProcessSync:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


__all__ = ["InProcessSync"]
