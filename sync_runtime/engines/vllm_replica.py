"""A Ray actor owning one `vllm.LLM` whose workers are WeightSync destination ranks.

Discovery finds the actor by name like any participant; its `ws_meta()` returns one
ParticipantMeta per worker, and discovery turns each into a rank handle whose calls arrive here
as `ws_rank_call(local_index, method, args)`. The actor is threaded (max_concurrency > ranks):
the calls its ranks make for one method are batched into ONE
`llm.collective_rpc("ws_dispatch", args=(method, {local_index: args}))`, because collective_rpc
cannot run concurrently on one engine, and ranks that rendezvous with each other (ws_join,
ws_run) must be inside the same call. Only control data crosses collective_rpc; the shards
travel over the sync's process group straight into each worker's host staging.

Serving: `vllm.LLM` is synchronous. `generate` and every collective_rpc take the same engine
lock, so a generation runs either wholly before or wholly after a commit's apply and never sees
a half-applied model. The transfer (`ws_run`) also holds the lock: with `LLM` generation waits
for it (an AsyncLLM server could keep serving during ws_run, see docs/vllm.md).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sync_runtime.errors import DestinationError, ParticipantDied, WeightSyncError
from sync_runtime.runtime.participant import ParticipantMeta

WORKER_EXTENSION = "sync_runtime.engines.vllm_worker.VllmWorkerExtension"
RENDEZVOUS = frozenset({"ws_join", "ws_run"})
"""Methods whose ranks block on each other: wait for every local rank before dispatching."""
RENDEZVOUS_WAIT_S = 30.0
GATHER_WINDOW_S = 0.05
"""Other methods: dispatch what arrived within this window (a rank called alone still runs)."""


@dataclass
class _Batch:
    method: str
    args: dict[int, tuple] = field(default_factory=dict)
    closed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    results: list[tuple[str, Any]] = field(default_factory=list)
    error: Exception | None = None


class VllmReplica:
    """One inference replica: a `vllm.LLM` (TP 1 or 2) plus the WeightSync rank protocol.

    Wrap with `ray.remote(...).options(max_concurrency=...)` (see `replica_options`).
    """

    def __init__(
        self,
        model: str,
        *,
        replica: int = 0,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        load_format: str = "dummy",
        dtype: str = "bfloat16",
        worker_extension_cls: str = WORKER_EXTENSION,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        import ray
        from vllm import LLM

        extra = {"max_model_len": 128, "max_num_seqs": 4, "enforce_eager": True, "seed": 0}
        extra.update(engine_args or {})
        self.llm = LLM(
            model=model,
            skip_tokenizer_init=True,  # token ids in, token ids out: no tokenizer files needed
            load_format=load_format,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            distributed_executor_backend="mp",  # workers are this actor's children (same node)
            enable_prefix_caching=False,
            worker_extension_cls=worker_extension_cls,
            **extra,
        )
        self._engine = threading.Lock()
        self._cv = threading.Condition()
        self._open: dict[str, _Batch] = {}
        ctx = ray.get_runtime_context()
        node = ray.util.get_node_ip_address()
        name, actor_id = ctx.get_actor_name() or "", ctx.get_actor_id() or ""
        self._ranks = tensor_parallel_size  # pp = 1: local index = tp rank
        setup = {i: (replica, node, name, actor_id) for i in range(self._ranks)}
        try:
            metas = [_value(r) for r in self._rpc("ws_setup", setup)]
            for i, m in enumerate(metas):
                if m.coord.pp_rank * tensor_parallel_size + m.coord.tp_rank != i:
                    raise DestinationError(f"worker {i} reports {m.coord}: vLLM's worker order changed")
        except BaseException:
            # A failed actor constructor exits its process without running LLM's finalizers:
            # stop the engine first, or its worker processes outlive the actor.
            self.shutdown()
            raise

    # ---- the WeightSync protocol ------------------------------------------------------------

    def ws_meta(self) -> list[ParticipantMeta]:
        """One meta per worker (fresh: version and group health)."""
        return [_value(r) for r in self._rpc("ws_meta", {i: () for i in range(self._ranks)})]

    def ws_num_ranks(self) -> int:
        return self._ranks

    def ws_rank_call(self, index: int, method: str, args: Sequence[Any]) -> Any:
        """`method(*args)` on local rank `index`, batched with the same method of other ranks."""
        if not 0 <= index < self._ranks:
            raise DestinationError(f"no local rank {index} (this replica has {self._ranks})")
        batch, leader = self._join_batch(index, method, tuple(args))
        if leader:
            self._run_batch(batch)
        batch.done.wait()
        if batch.error is not None:
            raise batch.error
        kind, value = batch.results[index]
        if kind == "error":
            raise value
        if kind == "skip":
            raise DestinationError(f"{method}: rank {index} was not dispatched")
        return value

    def _join_batch(self, index: int, method: str, args: tuple) -> tuple[_Batch, bool]:
        with self._cv:
            batch = self._open.get(method)
            if batch is None or batch.closed or index in batch.args:
                batch = self._open[method] = _Batch(method)
            batch.args[index] = args
            self._cv.notify_all()
            return batch, len(batch.args) == 1

    def _run_batch(self, batch: _Batch) -> None:
        wait = RENDEZVOUS_WAIT_S if batch.method in RENDEZVOUS else GATHER_WINDOW_S
        deadline = time.monotonic() + wait
        with self._cv:
            while len(batch.args) < self._ranks and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            batch.closed = True
            if self._open.get(batch.method) is batch:
                del self._open[batch.method]
        try:
            batch.results = self._rpc(batch.method, dict(batch.args))
            if batch.method == "ws_commit":
                self._label_version(batch)
        except Exception as e:  # the engine died (a worker was killed): every rank learns it
            batch.error = e if isinstance(e, WeightSyncError) else ParticipantDied(f"vLLM engine: {e!r}")
        finally:
            batch.done.set()

    def _label_version(self, batch: _Batch) -> None:
        """The engine's weight version label follows the workers once every rank committed."""
        committed = {r[1] for r in batch.results if r[0] == "ok"}
        if (
            len(batch.args) == self._ranks
            and len(committed) == 1
            and all(r[0] == "ok" for r in batch.results)
        ):
            with self._engine:
                self.llm.llm_engine.set_weight_version(str(committed.pop()))

    def _rpc(self, method: str, per_rank: dict[int, tuple]) -> list[tuple[str, Any]]:
        payload = pickle.dumps(per_rank)  # control data only; see VllmWorkerExtension.ws_dispatch
        with self._engine:
            answers = self.llm.collective_rpc("ws_dispatch", args=(method, payload))
        return [pickle.loads(a) for a in answers]

    # ---- serving ----------------------------------------------------------------------------

    def generate(
        self, prompt_token_ids: list[list[int]], max_tokens: int = 16, *, one_at_a_time: bool = False
    ) -> list[dict[str, list]]:
        """Greedy generation: per prompt the chosen token ids and their logprobs.

        `one_at_a_time`: each prompt in a batch of its own. Which requests share an engine step
        depends on timing, and vLLM's CPU MLA kernels are not batch-invariant (the same engine's
        batched calls differ in logprob bits and then tokens); alone, every prompt's result
        depends on the weights only, so engines can be compared bit for bit.
        """
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False
        )
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        batches = [[p] for p in prompts] if one_at_a_time else [prompts]
        with self._engine:  # never concurrent with an apply (or any other collective_rpc)
            outs = [o for batch in batches for o in self.llm.generate(batch, params, use_tqdm=False)]
        rows = []
        for o in outs:
            c = o.outputs[0]
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)]
            rows.append({"token_ids": list(c.token_ids), "logprobs": lps})
        return rows

    def weight_version(self) -> str:
        with self._engine:
            return str(self.llm.llm_engine.get_weight_version())

    def shutdown(self) -> None:
        """Stop the engine's processes now (before ray.kill, so no worker outlives the actor)."""
        with self._engine:
            self.llm.llm_engine.engine_core.shutdown()


def _value(result: tuple[str, Any]) -> Any:
    kind, value = result
    if kind == "error":
        raise value
    return value


def replica_options(
    name: str, namespace: str, tensor_parallel_size: int, env: dict[str, str]
) -> dict[str, Any]:
    """Ray options for a VllmReplica: named for discovery, threaded beyond its rank count,
    no CPUs claimed (vLLM's mp workers are this actor's children; Ray does not see them)."""
    return {
        "name": name,
        "namespace": namespace,
        "num_cpus": 0,
        "max_concurrency": 4 * tensor_parallel_size + 4,
        "runtime_env": {"env_vars": dict(env)},
    }
