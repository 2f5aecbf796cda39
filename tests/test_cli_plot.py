"""`weightsync plan --plot`: the title names model and topologies; the ticks name each rank's place."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.planner import plan_sync

pytestmark = pytest.mark.unit


def args(**over: object) -> argparse.Namespace:
    base = dict(
        model="tiny-qwen3-moe",
        src="tp=2,pp=2,dp=2",
        dst=["tp=2,replicas=2"],
        src_layout="megatron",
        dst_layout=None,
        gpus_per_node=8,
        bucket_mb=64,
        staging_mb=512,
        max_fan_in=4,
        relay="off",
    )
    return argparse.Namespace(**{**base, **over})


def test_title_and_ticks_name_model_topologies_and_ranks(tmp_path: Path) -> None:
    inputs = cli.sync_inputs(args())
    plan = plan_sync(inputs.manifest, inputs.source, inputs.destinations, inputs.config)
    title = cli.heatmap_title(cli.plan_summary(inputs, plan), "tiny-qwen3-moe")
    assert (
        title.startswith("tiny-qwen3-moe (qwen3_moe): megatron:")
        and "tp=2,pp=2,dp=2" in title
        and "vllm:" in title
    )
    rows, cols = cli.write_heatmap(plan, str(tmp_path / "p.png"), title=title)
    assert (tmp_path / "p.png").stat().st_size > 1000
    # 8 source ranks send (dp copies share the load), 4 destination ranks receive.
    assert rows[0] == "0: pp0 dp0 tp0" and any(r.endswith("pp1 dp1 tp1") for r in rows)
    assert cols[0] == "8: r0 tp0" and cols[-1] == "11: r1 tp1", cols
    assert len(rows) <= 32 and len(cols) <= 32


def test_several_destinations_are_told_apart() -> None:
    inputs = cli.sync_inputs(args(dst=["tp=2,replicas=1", "tp=1,replicas=2"]))
    labels = [cli.rank_label(c) for d in inputs.destinations for c in d.coords]
    assert labels == ["d0 r0 tp0", "d0 r0 tp1", "d1 r0 tp0", "d1 r1 tp0"]


def test_context_parallel_source_ranks_are_told_apart() -> None:
    inputs = cli.sync_inputs(args(src="tp=2,cp=2"))
    labels = [cli.rank_label(c) for c in inputs.source.coords]
    assert len(set(labels)) == len(labels) == 4 and "pp0 dp0 cp1 tp1" in labels, labels


def test_plot_command_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.png"
    assert (
        cli.main(["plan", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=1", "--plot", str(out)]) == 0
    )
    assert out.stat().st_size > 1000 and "heatmap" in capsys.readouterr().out
