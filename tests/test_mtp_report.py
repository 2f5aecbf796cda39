"""The sync report names the MTP part (DeepSeek-V3's num_nextn_predict_layers) a destination is not sent."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec, Role, enumerate_ranks
from sync_runtime.planner import PlannerConfig, SideSpec, plan_sync
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.report_plan import plan_fields
from sync_runtime.schema.report import SyncReport, SyncResult

pytestmark = pytest.mark.unit


def _report(preset: str, *, mtp: bool = False) -> SyncReport:
    manifest = build_manifest(load_model_config(preset))
    src, dst = ParallelSpec(tp=2), ParallelSpec(tp=2)
    plan = plan_sync(
        manifest,
        # The MTP case from an hf source (a megatron one places MTP too: test_megatron_mtp_layout).
        SideSpec("hf" if mtp else "megatron", src, tuple(enumerate_ranks(src, Role.SOURCE))),
        [SideSpec("vllm", dst, tuple(enumerate_ranks(dst, Role.DESTINATION)), mtp)],
        PlannerConfig(),
    )
    now = datetime.now(UTC)
    fields = plan_fields(plan)
    assert fields["plan_digest"] == plan.digest and fields["rounds"] == len(plan.rounds) > 0
    return SyncReport(version="v1", started_at=now, finished_at=now, result=SyncResult.SUCCEEDED, **fields)


def test_mtp_not_sent_is_listed_in_the_report() -> None:
    report = _report("tiny-deepseek-v3")  # num_nextn_predict_layers=1, 3 decoder layers
    assert report.not_synced == [
        "destination 0 (vllm:tp=2,pp=1): mtp: 1 layer (model.layers.3.*), 838,080 bytes canonical, "
        "not sent: destination does not serve MTP"
    ]
    wire = report.model_dump(mode="json", by_alias=True)
    assert wire["notSynced"] == report.not_synced
    assert SyncReport.model_validate(wire) == report


def test_a_destination_serving_mtp_leaves_nothing_out() -> None:
    assert _report("tiny-deepseek-v3", mtp=True).not_synced == []


def test_a_model_without_mtp_reports_nothing_left_out() -> None:
    assert _report("tiny-qwen3-moe").not_synced == []
    assert plan_fields(None) == {}  # no plan (discovery failed): the report's defaults
