"""`weightsync plan` / `simulate` through `main([...])`: JSON figures, one-line errors, the heatmap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.core.manifest import Manifest, TensorMeta

pytestmark = pytest.mark.unit

JSON_KEYS = {
    "plan_seconds",
    "tensors",
    "transfers",
    "rounds",
    "wire_bytes",
    "lower_bound_bytes",
    "max_send_bytes",
    "mean_send_bytes",
    "max_recv_bytes",
    "mean_recv_bytes",
    "predicted_seconds",
    "floor_seconds",
    "digest",
    "relay",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_consistent_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "tiny-qwen3-moe",
        "--src",
        "tp=2,pp=2,dp=2,ep=4",
        "--dst",
        "tp=2,ep=2,replicas=2",
        "--json",
        "--bucket-mb",
        "0.01",
        "--staging-mb",
        "0.05",
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary.keys() >= JSON_KEYS
    assert summary["wire_bytes"] == summary["lower_bound_bytes"]
    # two replicas, and every TP rank holds its own copy of norms and routers
    assert summary["lower_bound_bytes"] > 2 * summary["model_bytes"]
    assert summary["relay"] is False
    assert summary["max_send_bytes"] >= summary["mean_send_bytes"] > 0
    assert summary["predicted_seconds"] >= summary["floor_seconds"] > 0
    assert summary["rounds"] > 1
    assert len(summary["digest"]) == 64


def test_plan_json_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("plan", "--model", "tiny-llama", "--src", "tp=2,pp=2", "--dst", "tp=4,replicas=2", "--json")
    digests = {json.loads(run(capsys, *argv)[1])["digest"] for _ in range(2)}
    assert len(digests) == 1


def test_plan_several_destinations_and_relay(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "tiny-llama",
        "--src",
        "tp=2",
        "--dst",
        "tp=4,replicas=3",
        "--dst",
        "tp=1",
        "--dst-layout",
        "vllm",
        "--dst-layout",
        "hf",
        "--relay",
        "on",
        "--json",
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["destinations"] == ["vllm:tp=4,pp=1,replicas=3", "hf:tp=1,pp=1"]
    assert summary["relay"] is True
    assert summary["dst_ranks"] == 13


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=4")
    assert code == 0
    for label in ("tensors", "rounds", "wire / lower bound", "predicted / floor", "digest"):
        assert label in out


def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "heat.png"
    code, _, err = run(
        capsys,
        "plan",
        "--model",
        "tiny-llama",
        "--src",
        "tp=2,dp=2",
        "--dst",
        "tp=4,replicas=2",
        "--json",
        "--plot",
        str(target),
    )
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "simulate",
        "--model",
        "tiny-deepseek-v3",
        "--src",
        "tp=2,pp=3,ep=2",
        "--dst",
        "tp=4,ep=4,replicas=2",
        "--bucket-mb",
        "0.01",
        "--staging-mb",
        "0.04",
    )
    assert code == 0, err
    assert out.startswith("OK")


def test_simulate_reports_a_mismatch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sync_runtime.planner.simulate as sim

    real = sim.simulate

    def corrupt(*args: Any, **kwargs: Any) -> tuple:
        dst, counts = real(*args, **kwargs)
        array = next(iter(next(iter(dst.values())).values()))
        array.flat[0] ^= 1
        return dst, counts

    monkeypatch.setattr(sim, "simulate", corrupt)
    code, out, _ = run(capsys, "simulate", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=2")
    assert code == 1
    assert out.startswith("MISMATCH")


def test_simulate_refuses_big_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "--model", "llama-3-70b", "--src", "tp=8", "--dst", "tp=8")
    assert code == 2
    assert err.startswith("weightsync: error:") and "MiB" in err


@pytest.mark.parametrize(
    ("model", "src", "dst", "needle"),
    [
        ("tiny-llama", "tp=3", "tp=2", "tp=3"),  # TP does not divide the heads
        ("tiny-llama", "tp=2", "tp=3", "tp=3"),
        ("tiny-qwen3-moe", "tp=2,ep=3", "tp=2", "ep=3"),  # EP does not divide the experts
        ("tiny-qwen3-moe", "tp=2", "tp=2,ep=4", "ep=4"),
        ("tiny-llama", "tp=1,pp=5", "tp=2", "pp=5"),  # more stages than layers
        ("tiny-llama", "tp=2", "tp=2,pp=9", "pp=9"),
        ("tiny-llama", "tp=x", "tp=2", "tp"),  # unparsable specs
        ("tiny-llama", "tp8", "tp=2", "tp8"),
        ("tiny-llama", "tp=2,zz=1", "tp=2", "zz"),
        ("tiny-llama", "tp=0", "tp=2", "tp=0"),
        ("no-such-model", "tp=2", "tp=2", "no-such-model"),
    ],
)
def test_bad_topologies_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], model: str, src: str, dst: str, needle: str
) -> None:
    code, out, err = run(capsys, "plan", "--model", model, "--src", src, "--dst", dst)
    assert code == 2
    assert out == ""
    assert err.startswith("weightsync: error: ")
    assert err.count("\n") == 1
    assert needle in err


def test_tensor_no_layout_covers_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = cli.build_manifest

    def with_stray_tensor(config: dict) -> Manifest:
        manifest = real(config)
        extra = TensorMeta("model.stray.weight", (4, 4))
        return type(manifest)(manifest.family, (*manifest.tensors, extra), manifest.config, manifest.dtype)

    monkeypatch.setattr(cli, "build_manifest", with_stray_tensor)
    code, _, err = run(capsys, "plan", "--model", "tiny-llama", "--src", "tp=2", "--dst", "tp=2")
    assert code == 2
    assert err.count("\n") == 1 and "model.stray.weight" in err


def test_missing_delegate_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(cli.DELEGATES, "demo", "sync_runtime.no_such_module")
    code, _, err = run(capsys, "demo")
    assert code == 2
    assert err.startswith("weightsync: error: sync_runtime.no_such_module cannot be imported")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "--model", "tiny-llama")
    assert code == 2
    assert "--src" in err
