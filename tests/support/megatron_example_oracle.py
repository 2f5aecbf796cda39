"""examples/megatron_to_vllm.py's main(), its checkpoint-loaded oracle engine's outputs taken from
the reference cache (sync_runtime/testing/reference_cache.py): tests/engines/test_vllm_examples.py
runs this script instead of the example so that the oracle engine starts only on a cache miss.

Everything else is the example's own code, unchanged: its trainers, the checkpoint it writes (whose
bytes are part of the key), the synced engine, the sync and the verdict (after the sync equal to
the oracle, before it different). The example itself keeps no cache logic (it is user-facing);
this script replaces one name in the loaded module, `run_engine`, for `load_format="auto"` (the
oracle) only. Prints one line saying where the oracle's outputs came from.

    VE=$(bash tools/vllm_env.sh); PYTHONPATH=$PWD $VE/bin/python tests/support/megatron_example_oracle.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import ray
import ray.cloudpickle

from sync_runtime.testing import reference_cache
from sync_runtime.testing.vllm_oracle_keys import tuning_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_to_vllm.py"
ORACLE_CODE = ("Rollout", "engine_env", "run_engine")
"""The example's code that starts its oracle and asks it: any change to it is a new key."""
Outputs = list[tuple[list[int], list[float]]]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megatron_to_vllm_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # its actor classes travel to Ray's workers by value, as they do when the example runs as __main__
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def oracle_key(example: ModuleType, model_dir: str) -> dict[str, Any]:
    """Everything the example's oracle outputs depend on: reference_cache.oracle_key's (versions,
    CPU, the model config, the checkpoint's bytes) plus the example's engine code and settings."""
    h = hashlib.sha256()
    for name in ORACLE_CODE:
        h.update(inspect.getsource(getattr(example, name)).encode())
    env = {k: v for k, v in example.engine_env().items() if k != "PYTHONPATH"}
    engine = {"example": EXAMPLE.name, "code": h.hexdigest(), "env": {**tuning_env(), **env}}
    sampling = {"temperature": 0.0, "max_tokens": example.MAX_TOKENS, "logprobs": 0, "ignore_eos": True}
    return reference_cache.oracle_key(
        model_dir, engine=engine, prompts=example.PROMPTS, sampling=sampling, outputs={"generate_calls": 1}
    )


@ray.remote(num_cpus=0)
class CachedOracle:
    """Stands in for the oracle's `Rollout` actor: answers PROMPTS with the cached outputs."""

    def __init__(self, prompts: list[list[int]], outputs: Outputs) -> None:
        self.prompts, self.outputs = prompts, outputs

    def generate(self, prompts: list[list[int]]) -> Outputs:
        assert prompts == self.prompts, "the cached oracle answers the example's PROMPTS only"
        return self.outputs

    def shutdown(self) -> None:
        pass


def main() -> int:
    example = load_example()
    start_engine = example.run_engine

    def run_engine(model_dir: str, load_format: str) -> Any:
        if load_format != "auto":
            return start_engine(model_dir, load_format)  # the engine under test: always real
        key = oracle_key(example, model_dir)
        value, status = reference_cache.load(key)
        if status != "hit":
            oracle = start_engine(model_dir, load_format)
            value = reference_cache.put(key, ray.get(oracle.generate.remote(example.PROMPTS)))
            ray.get(oracle.shutdown.remote())
            ray.kill(oracle)
        where = "no oracle engine started" if status == "hit" else "computed by its engine, stored"
        print(f"oracle: reference cache {status} ({where}): {reference_cache.entry_path(key)}", flush=True)
        outputs = [(list(ids), list(lps)) for ids, lps in value]  # JSON lists -> the example's tuples
        return CachedOracle.remote(example.PROMPTS, outputs)

    example.run_engine = run_engine
    return int(example.main())


if __name__ == "__main__":
    raise SystemExit(main())
