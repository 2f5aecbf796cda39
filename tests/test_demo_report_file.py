"""report.json of every demo's dump: the last sync's report, camelCase, and `syncs` listing every
sync of the run in order with its encoding, wire and full bytes and changed fraction."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sync_runtime.demo.dump import write_report
from sync_runtime.schema.report import SyncReport, SyncResult

pytestmark = pytest.mark.unit


def _report(version: str, encoding: str, wire: int, changed: float | None) -> SyncReport:
    now = datetime.now(UTC)
    return SyncReport(
        version=version, started_at=now, finished_at=now, result=SyncResult.SUCCEEDED,
        encoding=encoding, wire_bytes=wire, full_bytes=1000, changed_fraction=changed,
    )  # fmt: skip


def test_report_json_lists_every_sync(tmp_path: Path) -> None:
    reports = [
        _report("v1", "full", 1000, None),
        _report("v2", "delta", 40, 0.02),
        _report("v3", "mixed", 520, 0.03),
    ]
    write_report(tmp_path, reports[-1], reports)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["version"] == "v3" and doc["encoding"] == "mixed" and doc["wireBytes"] == 520
    assert doc["syncs"] == [
        {"version": "v1", "result": "Succeeded", "seconds": 0.0, "encoding": "full", "wireBytes": 1000,
         "fullBytes": 1000, "changedFraction": None},
        {"version": "v2", "result": "Succeeded", "seconds": 0.0, "encoding": "delta", "wireBytes": 40,
         "fullBytes": 1000, "changedFraction": 0.02},
        {"version": "v3", "result": "Succeeded", "seconds": 0.0, "encoding": "mixed", "wireBytes": 520,
         "fullBytes": 1000, "changedFraction": 0.03},
    ]  # fmt: skip
    # The rest is the last sync's report as the runtime writes it.
    del doc["syncs"]
    assert SyncReport.model_validate(doc) == reports[-1]


def test_a_single_sync_lists_itself(tmp_path: Path) -> None:
    write_report(tmp_path, _report("v1", "full", 1000, None))
    assert [s["version"] for s in json.loads((tmp_path / "report.json").read_text())["syncs"]] == ["v1"]
