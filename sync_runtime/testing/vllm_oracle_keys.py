"""The reference-cache keys of vLLM oracles, and the vLLM demos' opt-in use of the cache.

An oracle is vLLM loading a checkpoint with its own loader, run only for its greedy outputs
(sync_runtime/testing/reference_cache.py keeps them outside the clone). Three kinds:
- a `VllmReplica` actor (`replica_oracle_key`): the engine tests' oracles (tests/support/
  vllm_oracle.py);
- a user-style `vllm.LLM` actor (`vllm_user_engines.user_oracle_key`): the `--engine vllm`
  demo's;
- a `vllm serve` process queried over HTTP (`server_oracle_key`): the `--engine vllm-server` demo's.

The demos use the cache only when asked (`WEIGHTSYNC_REFERENCE_CACHE=1`; the tests set it): a
user's demo starts its oracle as always, unless they opt in too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sync_runtime.testing import reference_cache
from sync_runtime.testing import vllm_server as _server
from sync_runtime.testing.vllm_deploy import KV_CACHE_BYTES
from sync_runtime.testing.vllm_models import MAX_TOKENS, PROMPTS

SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0, "one_at_a_time": True}
"""How `generations` samples (greedy, each prompt alone): part of every replica oracle's key."""
REFERENCE_CACHE_ENV = "WEIGHTSYNC_REFERENCE_CACHE"
"""Set to 1: the vLLM demos take their oracle's outputs from the reference cache (opt-in)."""
SERVER_CODE = ("serve_args", "serve_env", "generate", "complete", "completions")
"""The functions of sync_runtime/testing/vllm_server.py that shape a server oracle's answers:
how the server is started (its arguments, its environment) and how it is asked."""
ORACLE_LINE = re.compile(
    r"oracle: (?P<source>from the reference cache \(hit, no oracle engine started\)"
    r"|computed by its engine \(reference cache (?:miss|refused), stored\)): (?P<path>\S+\.json)"
)
"""`DemoOracle.line` with the cache on (the demo tests read it): a hit, or a miss just stored."""
TUNING_ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "MKL_", "TORCH_")
"""Inherited environment variables that may steer a demo oracle's kernels (thread counts and
binding, vLLM's CPU backend settings): their values are part of the demos' keys."""
NOT_TUNING = frozenset({"VLLM_PART", "VLLM_FILES", "VLLM_RPC_BASE_PATH"})
"""Variables with a tuning prefix that steer no kernel. The Makefile's own pick which test files
run: make exports a variable given on its command line (`make test-vllm VLLM_PART=a`, as `make
test`'s lanes run), so keeping them made `make test-vllm` alone, or a module moved from one lane
to the other, miss every oracle `make test` had stored. `VLLM_RPC_BASE_PATH` is where vLLM puts
its IPC sockets: a folder of each test session's own (tests/conftest.py)."""


def replica_oracle_key(
    model_dir: str | Path, engine: Mapping[str, Any], calls: int, *, kernel_checksums: bool = True
) -> dict[str, Any]:
    """The key of a VllmReplica oracle: `engine` are its start_replica arguments, `calls` how many
    times it generates PROMPTS (0: kernel checksums only), `kernel_checksums` whether they are
    part of its value."""
    args = {"tp": 1, "ep": False, "kv_cache_memory_bytes": KV_CACHE_BYTES, **engine, "load_format": "auto"}
    outputs = {"generate_calls": calls, "kernel_checksums": kernel_checksums}
    return reference_cache.oracle_key(
        model_dir, engine=args, prompts=PROMPTS, sampling=SAMPLING, outputs=outputs
    )


def server_code_digest() -> str:
    """sha256 over the sources of SERVER_CODE (a renamed function raises: rename it here too)."""
    path = Path(_server.__file__)
    text = path.read_text()
    h = hashlib.sha256()
    for name in SERVER_CODE:
        h.update(name.encode() + b"\0")
        h.update(hashlib.sha256(reference_cache.source_of(text, name, str(path)).encode()).digest())
    return h.hexdigest()


def tuning_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith(TUNING_ENV_PREFIXES) and k not in NOT_TUNING}


def server_oracle_key(model_dir: str | Path, *, tp: int, calls: int, warmups: int) -> dict[str, Any]:
    """The key of a `vllm serve` oracle started as the server demo starts it (vLLM's loader, no
    weightsync backend): `warmups` generate requests of PROMPTS[0], then `calls` rounds of
    `completions`. The model directory's path and the port are not part of it (the config and the
    weights' bytes are); the command line, the server's environment (but PYTHONPATH) and the
    inherited tuning variables are."""
    args = _server.serve_args("<model_dir>", 0, tp=tp, load_format="auto", backend=False)
    env = {k: v for k, v in _server.serve_env(tp).items() if k != "PYTHONPATH"}
    engine = {
        "server": "vllm serve",
        "args": args,
        "env": {**tuning_env(), **env},  # serve() lays serve_env over the inherited environment
        "client_code": server_code_digest(),
    }
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0, "route": "/v1/completions"}
    outputs = {"completions_calls": calls, "warmup_generate_calls": warmups}
    return reference_cache.oracle_key(
        model_dir, engine=engine, prompts=PROMPTS, sampling=sampling, outputs=outputs
    )


def cache_requested(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(REFERENCE_CACHE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class DemoOracle:
    """A demo oracle's outputs (per call, a Generation) as the cache holds them, or what to do
    on a miss: start the oracle, then `keep` its outputs. `status`: "off" (cache not asked
    for), "hit", "miss" or "refused" (reference_cache.load's)."""

    key: dict[str, Any] | None
    status: str
    runs: list[Any] | None = None

    @classmethod
    def look_up(
        cls, key: Callable[[], dict[str, Any]], environ: Mapping[str, str] | None = None
    ) -> DemoOracle:
        """`key` is built only when the cache is asked for (it hashes the checkpoint)."""
        if not cache_requested(environ):
            return cls(None, "off")
        wanted = key()
        value, status = reference_cache.load(wanted)
        runs = value.get("calls") if status == "hit" and isinstance(value, dict) else None
        if status == "hit" and not isinstance(runs, list):
            status = "refused"  # an entry of another shape under this key: recompute it
        return cls(wanted, status, runs)

    @property
    def cached(self) -> bool:
        return self.runs is not None

    def keep(self, runs: Sequence[Any]) -> list[Any]:
        """The oracle's outputs just computed, stored when the cache is on; returned as a hit
        returns them (read back from JSON)."""
        if self.key is None:
            return list(runs)
        self.runs = reference_cache.put(self.key, {"calls": list(runs)})["calls"]
        return list(self.runs)

    def line(self) -> str:
        """One line for the demo's output: where its oracle's outputs came from."""
        if self.key is None:
            return f"oracle: computed by its engine (reference cache off: {REFERENCE_CACHE_ENV} unset)"
        path = reference_cache.entry_path(self.key)
        if self.status == "hit":
            return f"oracle: from the reference cache (hit, no oracle engine started): {path}"
        return f"oracle: computed by its engine (reference cache {self.status}, stored): {path}"
