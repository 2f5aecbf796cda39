"""The vLLM oracles' reference-cache keys (sync_runtime/testing/vllm_oracle_keys.py) and the demos'
opt-in lookup: what an oracle's output depends on changes its key, what it does not (the model
directory's path) does not; without WEIGHTSYNC_REFERENCE_CACHE the demos neither read nor write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sync_runtime.testing import reference_cache
from sync_runtime.testing import vllm_oracle_keys as keys

pytestmark = pytest.mark.unit
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2}
RUNS = [[{"token_ids": [5, 7], "logprobs": [-0.1 - 0.2, -0.0]}]] * 2


def _model(directory: Path, weights: bytes = b"weights-v1", config: dict[str, Any] = CONFIG) -> str:
    """A model directory as the demos write one: config.json and the checkpoint's bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(weights)
    return str(directory)


def _replica(model_dir: str, **kw: Any) -> dict[str, Any]:
    return keys.replica_oracle_key(model_dir, {"tp": kw.pop("tp", 1)}, calls=2, **kw)


def _server(model_dir: str, tp: int = 1) -> dict[str, Any]:
    return keys.server_oracle_key(model_dir, tp=tp, calls=2, warmups=1)


@pytest.mark.parametrize("build", [_replica, _server], ids=["replica", "server"])
def test_the_same_oracle_in_another_directory_has_the_same_key(tmp_path: Path, build: Any) -> None:
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b")
    assert reference_cache.entry_path(build(a)) == reference_cache.entry_path(build(b))


@pytest.mark.parametrize("build", [_replica, _server], ids=["replica", "server"])
def test_changed_weights_or_config_or_tp_change_the_key(tmp_path: Path, build: Any) -> None:
    base = build(_model(tmp_path / "base"))
    flipped = build(_model(tmp_path / "w", weights=b"weights-v2"))  # one byte differs
    config = build(_model(tmp_path / "c", config={**CONFIG, "hidden_size": 128}))
    tp2 = build(_model(tmp_path / "t"), tp=2)
    digests = {reference_cache.entry_path(k).name for k in (base, flipped, config, tp2)}
    assert len(digests) == 4
    assert flipped["weights_sha256"] != base["weights_sha256"]
    assert config["model_config"]["hidden_size"] == 128


def test_a_replica_oracles_kernel_checksums_are_part_of_its_key(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    demo, tests = _replica(model, kernel_checksums=False), _replica(model)
    assert demo != tests
    # start_replica's arguments with its defaults, the KV cache size among them
    assert tests["engine"] == {"tp": 1, "ep": False, "kv_cache_memory_bytes": 64 << 20, "load_format": "auto"}
    assert tests["outputs"] == {"generate_calls": 2, "kernel_checksums": True}
    assert tests["sampling"] == {"temperature": 0.0, "max_tokens": 16, "logprobs": 0, "one_at_a_time": True}


def test_a_server_oracles_key_covers_its_command_line_and_tuning_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path / "m")
    base = _server(model)
    args = base["engine"]["args"]
    assert "--load-format=auto" in args and "--weight-transfer-config" not in args  # no backend
    assert "--model=<model_dir>" in args and "PYTHONPATH" not in base["engine"]["env"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a thread count may change a GEMM's sums
    assert _server(model) != base
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "x")
    assert _server(model) == base
    monkeypatch.setenv("VLLM_PART", "b")  # the Makefile's, exported by `make test-vllm VLLM_PART=b`
    monkeypatch.setenv("VLLM_FILES", "tests/engines/test_vllm_server.py")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path / "ipc"))  # where sockets go (the session's)
    assert _server(model) == base
    more = keys.server_oracle_key(model, tp=1, calls=2, warmups=2)
    assert more != base  # another request sequence before the kept calls


def test_without_the_variable_the_demo_oracle_is_off_and_builds_no_key(tmp_path: Path) -> None:
    def no_key() -> dict[str, Any]:
        raise AssertionError("the key (a hash of the checkpoint) was built with the cache off")

    for env in ({}, {keys.REFERENCE_CACHE_ENV: "0"}, {keys.REFERENCE_CACHE_ENV: ""}):
        oracle = keys.DemoOracle.look_up(no_key, env)
        assert (oracle.status, oracle.cached, oracle.keep(RUNS)) == ("off", False, RUNS)
        assert "reference cache off" in oracle.line()


def test_a_miss_is_stored_and_the_next_lookup_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path / "cache"))
    env = {keys.REFERENCE_CACHE_ENV: "1"}
    model = _model(tmp_path / "m")
    first = keys.DemoOracle.look_up(lambda: _replica(model, kernel_checksums=False), env)
    assert (first.status, first.cached) == ("miss", False)
    assert first.keep(RUNS) == RUNS
    stored = keys.ORACLE_LINE.fullmatch(first.line())  # the demo tests parse this line
    assert stored is not None and stored["source"].startswith("computed by its engine")
    second = keys.DemoOracle.look_up(lambda: _replica(model, kernel_checksums=False), env)
    assert (second.status, second.runs) == ("hit", RUNS)
    hit = keys.ORACLE_LINE.fullmatch(second.line())
    assert hit is not None and hit["source"].startswith("from the reference cache")
    assert hit["path"] == stored["path"] and Path(hit["path"]).parent == tmp_path / "cache" / "reference"
    # another checkpoint is another entry: a miss, not the first one's outputs
    other = _model(tmp_path / "o", weights=b"weights-v2")
    third = keys.DemoOracle.look_up(lambda: _replica(other, kernel_checksums=False), env)
    assert (third.status, third.runs) == ("miss", None)


def test_an_entry_of_another_shape_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path / "cache"))
    model = _model(tmp_path / "m")
    key = _server(model)
    reference_cache.store(key, {"not calls": 1})
    oracle = keys.DemoOracle.look_up(lambda: key, {keys.REFERENCE_CACHE_ENV: "1"})
    assert (oracle.status, oracle.cached) == ("refused", False)


def test_the_example_oracles_key_follows_its_checkpoint_and_engine_code(tmp_path: Path) -> None:
    """tests/support/megatron_example_oracle.py: the example's oracle (its own `Rollout`)."""
    from tests.support.megatron_example_oracle import ORACLE_CODE, load_example, oracle_key

    example = load_example()
    config = dict(example.HF_CONFIG)
    base = oracle_key(example, _model(tmp_path / "a", config=config))
    assert base == oracle_key(example, _model(tmp_path / "b", config=config))
    assert base != oracle_key(example, _model(tmp_path / "w", b"weights-v2", config=config))
    assert base["prompts"] == example.PROMPTS and "PYTHONPATH" not in base["engine"]["env"]
    # an edit of the code that starts or asks the oracle is another key
    assert "run_engine" in ORACLE_CODE
    example.run_engine = lambda model_dir, load_format: None
    assert oracle_key(example, _model(tmp_path / "a", config=config)) != base
