"""What a config says about its checkpoint is honoured or refused, never silently approximated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sync_runtime.cli import main as cli
from sync_runtime.core.models import load_model_config, not_synced
from sync_runtime.errors import ModelConfigError
from sync_runtime.runtime.hf_manifest import build_manifest

pytestmark = pytest.mark.unit


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_quantized_config_refused_naming_the_quantization() -> None:
    config = load_model_config("tiny-deepseek-v3") | {
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    }
    with pytest.raises(ModelConfigError) as info:
        build_manifest(config)
    line = str(info.value)
    assert "\n" not in line and "quant_method='fp8'" in line and "weight_block_size=[128, 128]" in line


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_config_dtype_honoured(key: str) -> None:
    base = {k: v for k, v in load_model_config("tiny-llama").items() if k not in ("torch_dtype", "dtype")}
    bf16 = build_manifest(base)
    fp32 = build_manifest(base | {key: "float32"})
    assert {t.dtype for t in bf16.tensors} == {"bfloat16"}
    assert {t.dtype for t in fp32.tensors} == {"float32"} and fp32.dtype == "float32"
    assert fp32.nbytes == 2 * bf16.nbytes


def test_unknown_dtype_refused() -> None:
    with pytest.raises(ModelConfigError, match="dtype 'int4'"):
        build_manifest(load_model_config("tiny-llama") | {"torch_dtype": "int4"})


def test_mtp_layers_are_a_part_of_the_manifest_or_named_as_not_synced() -> None:
    # DeepSeek-V3's MTP layer is the manifest's `mtp` part (tests/test_mtp_parts.py); a family
    # whose MTP form is not mapped (GLM-4.5) is still named, in one line, as not synced.
    config = load_model_config("deepseek-v3")
    assert not_synced(config) == []
    assert {t.name.split(".")[2] for t in build_manifest(config).mtp} == {"61"}
    assert not_synced(load_model_config("glm-4.5-air")) == [
        "1 MTP layer(s) (num_nextn_predict_layers=1, model.layers.46.*): not synced"
    ]
    assert build_manifest(load_model_config("glm-4.5-air")).mtp == ()
    assert not_synced(load_model_config("tiny-llama")) == []


def test_model_directory_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(load_model_config("tiny-qwen3")))
    assert load_model_config(tmp_path) == load_model_config("tiny-qwen3")
    with pytest.raises(ModelConfigError, match=r"without config\.json"):
        load_model_config(tmp_path / "..")


def test_plan_prints_mtp_and_takes_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # the table's lines unwrapped
    (tmp_path / "config.json").write_text(
        json.dumps(load_model_config("tiny-deepseek-v3") | {"num_nextn_predict_layers": 1})
    )
    code, out, err = _cli(
        capsys, "plan", "--model", str(tmp_path), "--src", "tp=2", "--dst", "tp=2", "--json"
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["not_synced"] == [
        "destination 0 (vllm:tp=2,pp=1): mtp: 1 layer (model.layers.3.*), 838,080 bytes canonical, "
        "not sent: destination does not serve MTP"
    ]
    code, out, _ = _cli(capsys, "plan", "--model", str(tmp_path), "--src", "tp=2", "--dst", "tp=2")
    assert code == 0 and "not synced" in out and "does not serve MTP" in out


def test_plan_refuses_quantized_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(load_model_config("tiny-qwen3") | {"quantization_config": {"quant_method": "fp8"}})
    )
    code, _, err = _cli(capsys, "plan", "--model", str(path), "--src", "tp=1", "--dst", "tp=1")
    assert code == 2
    assert err.count("\n") == 1 and "quant_method='fp8'" in err
