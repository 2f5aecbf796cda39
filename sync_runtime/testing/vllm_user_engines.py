"""vLLM engines as users run them in Ray: a plain actor holding a `vllm.LLM` started with the
weightsync weight-transfer backend, attached as a destination replica the documented way
(`attach(name, namespace, ActorControl(actor))`, engines/vllm_actor.py). Used by
`weightsync demo --engine vllm` and the engine tests (tests/support/vllm_user.py).

`UserEngine` holds nothing from WeightSync: a user's actor with the same `vllm.LLM` needs no
method added (ActorControl reaches the engine through Ray's `__ray_call__`). vLLM itself is
imported only inside the actors (engine environment, tools/vllm_env.sh); this module imports
without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from sync_runtime.testing import reference_cache
from sync_runtime.testing.vllm_deploy import KV_CACHE_BYTES, READY_TIMEOUT_S, engine_env
from sync_runtime.testing.vllm_models import PROMPTS
from sync_runtime.testing.vllm_oracle_keys import SAMPLING, tuning_env

BACKEND = {"backend": "weightsync"}
"""vLLM's `weight_transfer_config` that makes an engine a WeightSync destination (the plugin)."""
ORACLE_CODE = ("engine_args", "greedy", "row_of", "UserEngine.__init__", "UserEngine.generate")
"""The functions of this module that shape a checkpoint-loaded `UserEngine`'s answers: part of
its reference-cache key (`user_oracle_key`)."""


def engine_args(model: str, tp: int, *, load_format: str = "dummy", backend: bool = True) -> dict[str, Any]:
    """The engine settings of every user engine here: those of the demo's and tests' engines
    (bf16, 128 tokens, 4 sequences, a small KV cache, eager, seed 0, no tokenizer), so they generate alike.
    `backend`: with the weightsync backend (a destination); without, an engine that only loads a
    checkpoint (`load_format="auto"`: an oracle)."""
    return {
        "model": model,
        "skip_tokenizer_init": True,  # token ids in, token ids out: no tokenizer files needed
        "load_format": load_format,
        "dtype": "bfloat16",
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "mp",  # the workers are the actor's children (one node)
        "enable_prefix_caching": False,
        "max_model_len": 128,
        "max_num_seqs": 4,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "enforce_eager": True,
        "seed": 0,
        **({"weight_transfer_config": dict(BACKEND)} if backend else {}),
    }


def greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False
    )


def row_of(completion: Any) -> dict:
    """A completion's token ids and the chosen tokens' logprobs."""
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [
            d[t].logprob for t, d in zip(completion.token_ids, completion.logprobs or [], strict=True)
        ],
    }


class UserEngine:
    """What a user writes: an actor holding a `vllm.LLM`, nothing from WeightSync."""

    def __init__(
        self,
        model: str,
        tp: int,
        extra: dict[str, Any] | None = None,
        *,
        load_format: str = "dummy",
        backend: bool = True,
    ) -> None:
        """`extra`: more vLLM engine arguments (e.g. a speculative config: test_vllm_mtp.py)."""
        from vllm import LLM

        args = engine_args(model, tp, load_format=load_format, backend=backend)
        self.llm = LLM(**(args | (extra or {})))

    def start(self) -> str:
        """The engine is up (built in the constructor): its weight version label."""
        return self.weight_version()

    def generate(self, rows: list[list[int]], max_tokens: int, *, one_at_a_time: bool) -> list[dict]:
        """Greedy generation, each row in an engine step of its own (always: `one_at_a_time` is
        accepted for `vllm_deploy.generations`). vLLM's CPU MLA kernels are not batch-invariant;
        alone, a row's tokens and logprobs depend on the weights only, so engines compare bit
        for bit."""
        del one_at_a_time
        outs = [
            self.llm.generate([{"prompt_token_ids": r}], greedy(max_tokens), use_tqdm=False)[0] for r in rows
        ]
        return [row_of(o.outputs[0]) for o in outs]

    def weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def shutdown(self) -> None:
        """Stop the engine's processes now (before ray.kill, so no worker outlives the actor)."""
        self.llm.llm_engine.engine_core.shutdown()


def start_user_engine(
    model_dir: str,
    tp: int,
    extra: dict[str, Any] | None = None,
    *,
    load_format: str = "dummy",
    backend: bool = True,
    name: str | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """A `UserEngine` actor (returns at once; the engine builds in its constructor, in the
    background: wait with `wait_started`). Unnamed unless `name`: discovery finds the destination
    by its WeightSync proxy's name (`attach_user_engines`), never by the user's actor. `extra`:
    more vLLM engine arguments; `env`: the actor's environment (default `engine_env(tp)`)."""
    options: dict[str, Any] = {
        "num_cpus": 0,
        "runtime_env": {"env_vars": env if env is not None else engine_env(tp)},
    }
    if name is not None:
        options["name"] = name
    return (
        ray.remote(UserEngine)
        .options(**options)
        .remote(model_dir, tp, extra, load_format=load_format, backend=backend)
    )


def wait_started(engines: Sequence[Any], timeout_s: float = READY_TIMEOUT_S) -> list[str]:
    """Block until every engine is up; their weight version labels."""
    return [str(v) for v in ray.get([e.start.remote() for e in engines], timeout=timeout_s)]


def attach_user_engines(
    engines: Sequence[Any], prefix: str, namespace: str, *, tp: int, timeout_s: float = READY_TIMEOUT_S
) -> list[Any]:
    """Replica k of destination `prefix` is `engines[k]`, attached as a user attaches theirs: a
    `VllmEngineRanks` proxy named `{prefix}r{k}` over `ActorControl(engine)`; returned once every
    proxy has set up its engine's workers as destination ranks."""
    from sync_runtime.engines.vllm_actor import ActorControl
    from sync_runtime.engines.vllm_ranks import attach

    proxies = [
        attach(f"{prefix}r{k}", namespace, ActorControl(e), replica=k, ranks=tp)
        for k, e in enumerate(engines)
    ]
    ray.get([p.ws_num_ranks.remote() for p in proxies], timeout=timeout_s)
    return proxies


def oracle_code_digest(text: str | None = None) -> str:
    """sha256 over the sources of ORACLE_CODE in this module (or in `text`, another version of
    it); a renamed function raises: rename it in ORACLE_CODE too."""
    path = Path(__file__)
    source = path.read_text() if text is None else text
    h = hashlib.sha256()
    for name in ORACLE_CODE:
        h.update(name.encode() + b"\0")
        h.update(hashlib.sha256(reference_cache.source_of(source, name, str(path)).encode()).digest())
    return h.hexdigest()


def user_oracle_key(model_dir: str | Path, *, tp: int, calls: int) -> dict[str, Any]:
    """The reference-cache key of a checkpoint-loaded `UserEngine` (`backend=False`) asked
    `calls` times for `vllm_deploy.generations` of PROMPTS: its engine arguments (the model
    directory's path aside: its config and weights' bytes are in the key), the actor's
    environment (but PYTHONPATH) with the inherited tuning variables, and the code that shapes
    its answers."""
    env = {k: v for k, v in engine_env(tp).items() if k != "PYTHONPATH"}
    engine = {
        "actor": "vllm_user_engines.UserEngine",
        "args": engine_args("<model_dir>", tp, load_format="auto", backend=False),
        "env": {**tuning_env(), **env},  # Ray lays the runtime_env over the inherited environment
        "actor_code": oracle_code_digest(),
    }
    outputs = {"generate_calls": calls, "kernel_checksums": False}
    return reference_cache.oracle_key(
        model_dir, engine=engine, prompts=PROMPTS, sampling=SAMPLING, outputs=outputs
    )
