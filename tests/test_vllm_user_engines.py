"""The user-style vLLM engines of sync_runtime/testing/vllm_user_engines.py without vLLM: their
settings (a destination has the weightsync backend, the oracle does not) and the reference-cache
key of the checkpoint-loaded one, which must follow what its answers depend on (weights, config,
TP, tuning environment, the actor's code) and nothing else (the model directory's path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sync_runtime.testing import reference_cache
from sync_runtime.testing import vllm_user_engines as user

pytestmark = pytest.mark.unit
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2}


def _model(directory: Path, weights: bytes = b"weights-v1", config: dict[str, Any] = CONFIG) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(weights)
    return str(directory)


def test_a_destination_has_the_backend_and_the_oracle_loads_the_checkpoint_without_it() -> None:
    dest = user.engine_args("/m", 2)
    oracle = user.engine_args("/m", 2, load_format="auto", backend=False)
    assert dest["weight_transfer_config"] == {"backend": "weightsync"} and dest["load_format"] == "dummy"
    assert "weight_transfer_config" not in oracle and oracle["load_format"] == "auto"
    # otherwise the same engine: the demo compares their generations bit for bit
    same = {k: v for k, v in dest.items() if k not in ("weight_transfer_config", "load_format")}
    assert same == {k: v for k, v in oracle.items() if k != "load_format"}
    assert (same["max_model_len"], same["max_num_seqs"], same["seed"], same["dtype"]) == (
        128,
        4,
        0,
        "bfloat16",
    )
    assert same["enforce_eager"] and same["skip_tokenizer_init"] and same["tensor_parallel_size"] == 2
    assert "worker_extension_cls" not in dest  # the plugin, not our worker extension


def test_the_oracle_key_ignores_the_directory_and_follows_weights_config_and_tp(tmp_path: Path) -> None:
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b")
    base = user.user_oracle_key(a, tp=1, calls=2)
    assert reference_cache.entry_path(base) == reference_cache.entry_path(
        user.user_oracle_key(b, tp=1, calls=2)
    )
    others = [
        user.user_oracle_key(_model(tmp_path / "w", weights=b"weights-v2"), tp=1, calls=2),
        user.user_oracle_key(_model(tmp_path / "c", config={**CONFIG, "hidden_size": 128}), tp=1, calls=2),
        user.user_oracle_key(a, tp=2, calls=2),
        user.user_oracle_key(a, tp=1, calls=1),
    ]
    names = {reference_cache.entry_path(k).name for k in [base, *others]}
    assert len(names) == 5
    assert base["outputs"] == {"generate_calls": 2, "kernel_checksums": False}
    assert base["engine"]["args"]["model"] == "<model_dir>" and "PYTHONPATH" not in base["engine"]["env"]
    assert "weight_transfer_config" not in base["engine"]["args"]


def test_the_oracle_key_follows_the_tuning_environment_and_the_actors_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path / "m")
    base = user.user_oracle_key(model, tp=1, calls=2)
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "x")
    assert user.user_oracle_key(model, tp=1, calls=2) == base
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a thread count may change a GEMM's sums
    assert user.user_oracle_key(model, tp=1, calls=2) != base
    monkeypatch.delenv("OMP_NUM_THREADS")
    # another generate (how the actor asks vLLM) is another oracle; code outside ORACLE_CODE is not
    source = Path(user.__file__).read_text()
    edited = source.replace("del one_at_a_time", "del one_at_a_time  # changed", 1)
    elsewhere = source.replace("def wait_started(", "def wait_started(  # changed\n", 1)
    assert edited != source and elsewhere != source
    assert user.oracle_code_digest(edited) != user.oracle_code_digest() == user.oracle_code_digest(source)
    assert user.oracle_code_digest(elsewhere) == user.oracle_code_digest()
    assert base["engine"]["actor_code"] == user.oracle_code_digest()


def test_every_name_of_the_oracle_code_is_in_the_module() -> None:
    text = Path(user.__file__).read_text()
    for name in user.ORACLE_CODE:
        assert reference_cache.source_of(text, name, "vllm_user_engines.py")
    renamed = text.replace("def greedy(", "def greedy_sampling(", 1)
    with pytest.raises(LookupError, match="greedy"):  # a renamed function must not pass silently
        user.oracle_code_digest(renamed)
