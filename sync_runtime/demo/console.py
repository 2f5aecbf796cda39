"""Rich rendering of a sync for humans: a progress bar while bytes move, a summary afterwards."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from sync_runtime.schema.report import ProgressEvent, SyncReport, SyncResult, SyncStep


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class ConsoleReporter:
    """Reporter that draws stage lines and a transfer progress bar; keeps every finished report."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.reports: list[SyncReport] = []
        self._progress: Progress | None = None
        self._task: int | None = None
        self._stage: SyncStep | None = None

    def progress(self, event: ProgressEvent) -> None:
        if event.step is SyncStep.TRANSFER:
            self._transfer(event)
            return
        self._stop()
        if event.step is not self._stage:
            self.console.print(f"  [dim]{event.version}[/dim] {event.step.value} ...", highlight=False)
        self._stage = event.step

    def _transfer(self, event: ProgressEvent) -> None:
        if self._progress is None:
            self._progress = Progress(
                TextColumn(f"  {event.version} transfer"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("transfer", total=max(event.total_bytes, 1))
        assert self._task is not None
        self._progress.update(self._task, completed=event.done_bytes, total=max(event.total_bytes, 1))
        self._stage = SyncStep.TRANSFER

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress, self._task = None, None

    def finished(self, report: SyncReport) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=report.moved_bytes)
        self._stop()
        self._stage = None
        self.reports.append(report)
        if report.result is SyncResult.FAILED and report.failure is not None:
            f = report.failure
            self.console.print(
                f"[bold red]sync {report.version} FAILED[/] {f.reason} (rank {f.rank}, step "
                f"{f.step.value if f.step else '?'}): {f.message}"
            )


def summary_table(reports: Sequence[SyncReport], verified: Sequence[str]) -> Table:
    """One column per sync: stages, bytes, throughput, cache use, verification."""
    table = Table(title="WeightSync demo summary", show_lines=False)
    table.add_column("")
    for r in reports:
        table.add_column(f"sync {r.version}", justify="right")
    stages = ("discover", "plan", "connect", "transfer", "verify", "commit")
    for stage in stages:
        table.add_row(f"{stage} s", *(f"{getattr(r.stages, stage):.3f}" for r in reports))
    table.add_row("total s", *(f"{r.seconds:.3f}" for r in reports))
    table.add_row("bytes planned", *(human_bytes(r.planned_bytes) for r in reports))
    table.add_row("bytes moved", *(human_bytes(r.moved_bytes) for r in reports))
    table.add_row("throughput", *(f"{human_bytes(r.throughput_bytes_per_second)}/s" for r in reports))
    table.add_row("rounds / transfers", *(f"{r.rounds} / {r.transfers}" for r in reports))
    table.add_row("plan + group reused", *("yes" if r.plan_cached else "no (cold)" for r in reports))
    table.add_row("result", *(r.result.value for r in reports))
    table.add_row("verified", *verified)
    return table


def ranks_table(report: SyncReport) -> Table:
    """Per-rank bytes of one sync: shows the receiver-sharded, balanced traffic."""
    table = Table(title=f"per-rank bytes, sync {report.version}")
    for col in ("rank", "role", "actor", "sent", "received"):
        table.add_column(col, justify="right" if col in ("rank", "sent", "received") else "left")
    for r in report.ranks:
        table.add_row(str(r.rank), r.role, r.name, human_bytes(r.send_bytes), human_bytes(r.recv_bytes))
    return table
