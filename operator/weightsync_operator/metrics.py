"""Prometheus metrics of finished syncs, served on the operator's metrics port at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

DURATION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Seconds: from a warm tiny-model sync to a cold 1T-parameter one."""


class Metrics:
    """The operator's metrics on their own registry (tests build one each; no global state)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.syncs = Counter(
            "weightsync_syncs", "Finished syncs by result.", ["result"], registry=self.registry
        )
        self.duration = Histogram(
            "weightsync_sync_duration_seconds",
            "Wall time of finished syncs.",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.bytes = Counter(
            "weightsync_synced_bytes", "Bytes moved by finished syncs.", registry=self.registry
        )
        for result in ("Succeeded", "Failed"):
            self.syncs.labels(result=result)  # export zeros so rate() works before the first sync

    def observe_sync(self, result: str, seconds: float, moved_bytes: int) -> None:
        self.syncs.labels(result=result).inc()
        self.duration.observe(max(seconds, 0.0))
        self.bytes.inc(max(moved_bytes, 0))

    def serve(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)
