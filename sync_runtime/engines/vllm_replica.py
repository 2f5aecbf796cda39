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
from typing import Any

from sync_runtime.engines.vllm_batch import Batch, RankBatcher, Result, all_committed, value
from sync_runtime.errors import DestinationError
from sync_runtime.runtime.participant import ParticipantMeta

WORKER_EXTENSION = "sync_runtime.engines.vllm_worker.VllmWorkerExtension"


class VllmReplica(RankBatcher):
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
        ctx = ray.get_runtime_context()
        node = ray.util.get_node_ip_address()
        name, actor_id = ctx.get_actor_name() or "", ctx.get_actor_id() or ""
        self._init_batcher(tensor_parallel_size)  # pp = 1: local index = tp rank
        setup = {i: (replica, node, name, actor_id) for i in range(self._ranks)}
        try:
            metas = [value(r) for r in self._rpc("ws_setup", setup)]
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
        return [value(r) for r in self._rpc("ws_meta", {i: () for i in range(self._ranks)})]

    def _after_batch(self, batch: Batch) -> None:
        if batch.method == "ws_commit":
            self._label_version(batch)

    def _label_version(self, batch: Batch) -> None:
        """The engine's weight version label follows the workers once every rank committed."""
        committed = all_committed(batch, self._ranks)
        if committed is not None:
            with self._engine:
                self.llm.llm_engine.set_weight_version(committed)

    def _rpc(self, method: str, per_rank: dict[int, tuple]) -> list[Result]:
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
