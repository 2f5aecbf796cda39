"""The reference cache (sync_runtime/testing/reference_cache.py): a hit only for exactly the key
an entry records, logprobs bit for bit through the round trip, tampered entries refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from sync_runtime.testing import reference_cache as rc

pytestmark = pytest.mark.unit
KEY = {"format": rc.FORMAT, "model_config": {"hidden_size": 256}, "engine": {"tp": 2}, "seed": 0}
# logprobs whose shortest repr is long, a subnormal, a negative zero: all must come back as is
VALUE = {"calls": [[{"token_ids": [5, 7], "logprobs": [-0.1 - 0.2, -5e-324, -0.0, -1.1754943508e-38]}]]}


class Counter:
    def __init__(self, value: Any) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.value


def _bits(xs: list[float]) -> list[bytes]:
    return [struct.pack("<d", x) for x in xs]


def test_a_miss_computes_and_stores_then_a_hit_computes_nothing(tmp_path: Path) -> None:
    compute = Counter(VALUE)
    first = rc.cached(KEY, compute, root=tmp_path)
    second = rc.cached(KEY, compute, root=tmp_path)
    assert (first.status, second.status, compute.calls) == ("miss", "hit", 1)
    got = second.value["calls"][0][0]["logprobs"]
    assert _bits(got) == _bits(VALUE["calls"][0][0]["logprobs"])  # every bit, the zero's sign too
    assert first.value == second.value == VALUE


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"tp": 1}},
        {"seed": 1},
        {"model_config": {"hidden_size": 128}},
        {"extra": "anything"},
    ],
)
def test_any_change_of_the_key_is_a_miss(tmp_path: Path, change: dict[str, Any]) -> None:
    rc.store(KEY, VALUE, root=tmp_path)
    compute = Counter({"other": 1})
    got = rc.cached({**KEY, **change}, compute, root=tmp_path)
    assert got.status == "miss" and compute.calls == 1 and got.value == {"other": 1}


def _tamper_key(entry: dict[str, Any]) -> None:
    entry["key"]["seed"] = 1  # the file keeps its name: the recorded key no longer matches


def _tamper_value(entry: dict[str, Any]) -> None:
    entry["value"]["calls"][0][0]["token_ids"][0] = 6


def _tamper_format(entry: dict[str, Any]) -> None:
    entry["format"] = rc.FORMAT + 1


@pytest.mark.parametrize("tamper", [_tamper_key, _tamper_value, _tamper_format])
def test_a_tampered_entry_is_refused_and_replaced(tmp_path: Path, tamper: Any) -> None:
    path = rc.store(KEY, VALUE, root=tmp_path)
    entry = json.loads(path.read_text())
    tamper(entry)
    path.write_text(json.dumps(entry))
    assert rc.load(KEY, root=tmp_path) == (None, "refused")
    compute = Counter(VALUE)
    got = rc.cached(KEY, compute, root=tmp_path)
    assert got.status == "refused" and compute.calls == 1 and got.value == VALUE
    assert rc.load(KEY, root=tmp_path) == (VALUE, "hit")  # recomputed, stored anew


def test_an_unreadable_entry_is_refused(tmp_path: Path) -> None:
    path = rc.store(KEY, VALUE, root=tmp_path)
    path.write_text(path.read_text()[:-20])  # truncated
    assert rc.load(KEY, root=tmp_path) == (None, "refused")


def test_the_cache_lives_under_weightsync_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path))
    assert rc.cache_dir() == tmp_path / "reference"
    assert rc.entry_path(KEY).parent == tmp_path / "reference"


def _model(directory: Path, config: dict[str, Any], weights: bytes) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def test_oracle_key_holds_what_the_outputs_depend_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args: dict[str, Any] = {"engine": {"tp": 1}, "prompts": [[1, 2]], "sampling": {"max_tokens": 4}}
    args["outputs"] = {"generate_calls": 1}
    base = rc.oracle_key(_model(tmp_path / "a", {"h": 1}, b"w1"), **args)
    env = base["environment"]
    assert {"vllm", "torch", "cpu", "cpu_count", "python"} <= set(env)
    assert env["cpu"]["torch_capability"] and "machine" in env["cpu"]
    assert rc.oracle_key(_model(tmp_path / "same", {"h": 1}, b"w1"), **args) == base  # not the path
    assert rc.oracle_key(_model(tmp_path / "b", {"h": 1}, b"w2"), **args) != base  # weights' bytes
    assert rc.oracle_key(_model(tmp_path / "c", {"h": 2}, b"w1"), **args) != base  # model config
    assert env["torch_compile"]["TORCHDYNAMO_DISABLE"] == "1"  # the session's (tests/conftest.py)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")  # compiled helpers: another key
    assert rc.oracle_key(tmp_path / "a", **args) != base
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a place, not a switch
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # what `import vllm` sets: a speed
    assert rc.oracle_key(tmp_path / "a", **args) == base
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")  # a switch of what Inductor compiles
    assert rc.oracle_key(tmp_path / "a", **args) != base
    monkeypatch.delenv("TORCHINDUCTOR_FREEZING")
    for field, other in (("engine", {"tp": 2}), ("prompts", [[1, 3]]), ("sampling", {"max_tokens": 5})):
        assert rc.oracle_key(tmp_path / "a", **{**args, field: other}) != base, field
    (tmp_path / "a" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):  # no checkpoint bytes: no key
        rc.oracle_key(tmp_path / "a", **args)


SOURCE = """
def kept(x):
    return x + 1


class Engine:
    def generate(self):
        return "tokens"

    def apply(self):
        return "sync path"
"""


def test_engine_code_is_keyed_by_the_named_functions_only() -> None:
    """An oracle's key changes with the code that runs inside it, not with the rest of its files:
    editing a named method changes the digest of its source; editing another method does not."""
    assert rc.source_of(SOURCE, "Engine.generate").startswith("def generate(self):")
    assert rc.source_of(SOURCE, "kept") == "def kept(x):\n    return x + 1"
    edited_elsewhere = SOURCE.replace('"sync path"', '"a faster sync path"')
    assert rc.source_of(edited_elsewhere, "Engine.generate") == rc.source_of(SOURCE, "Engine.generate")
    edited_inside = SOURCE.replace('"tokens"', '"other tokens"')
    assert rc.source_of(edited_inside, "Engine.generate") != rc.source_of(SOURCE, "Engine.generate")
    with pytest.raises(LookupError, match=r"no function or class 'Engine\.load'"):
        rc.source_of(SOURCE, "Engine.load")


def test_every_name_the_engine_code_key_lists_exists() -> None:
    """A renamed function must be renamed in ENGINE_CODE too (else the key would miss it)."""
    digest = rc.engine_code_digest()
    assert len(digest) == 64 and digest == rc.engine_code_digest()
