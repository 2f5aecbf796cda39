"""A vLLM engine as a user runs it in Ray: an actor holding `vllm.LLM` with the weightsync
weight-transfer backend enabled, and nothing else from WeightSync (tests/engines/test_vllm_plugin.py).
Runs only under the engine environment (tools/vllm_env.sh).
"""

from __future__ import annotations


class UserEngine:
    """What a user writes: an actor holding a vLLM engine, nothing from WeightSync."""

    def __init__(self, model: str, tp: int) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype="bfloat16",
            tensor_parallel_size=tp,
            distributed_executor_backend="mp",
            enable_prefix_caching=False,
            max_model_len=128,
            max_num_seqs=4,
            enforce_eager=True,
            seed=0,
            weight_transfer_config={"backend": "weightsync"},
        )

    def generate(self, rows: list[list[int]], max_tokens: int, *, one_at_a_time: bool) -> list[dict]:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False
        )
        outs = [self.llm.generate([{"prompt_token_ids": r}], params, use_tqdm=False)[0] for r in rows]
        return [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [
                    d[t].logprob
                    for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)
                ],
            }
            for o in outs
        ]

    def weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class AsyncUserEngine:
    """What a user writes for rollouts (verl, SkyRL, NeMo-RL style): an async Ray actor holding an
    `AsyncLLM`, serving concurrent `generate` calls; from WeightSync only the adapter method."""

    def __init__(self, model: str, tp: int) -> None:
        self.model, self.tp = model, tp

    async def start(self) -> str:
        """Build the engine on the actor's event loop (AsyncLLM binds its output handler to it)."""
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        args = AsyncEngineArgs(
            model=self.model,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype="bfloat16",
            tensor_parallel_size=self.tp,
            distributed_executor_backend="mp",
            enable_prefix_caching=False,
            max_model_len=128,
            max_num_seqs=4,
            enforce_eager=True,
            seed=0,
            weight_transfer_config={"backend": "weightsync"},
        )
        self.engine = AsyncLLMEngine.from_engine_args(args)
        return str(await self.engine.get_weight_version())

    async def weightsync(self, op: str, *args: object) -> object:  # WeightSync: the one adapter
        from sync_runtime.engines.vllm_actor import weightsync_control

        return await weightsync_control(self.engine, op, *args)

    async def _one(self, row: list[int], max_tokens: int) -> tuple[dict, list[tuple[str, int, int]]]:
        import uuid

        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False
        )
        final = None
        async for out in self.engine.generate({"prompt_token_ids": row}, params, uuid.uuid4().hex):
            final = out
        assert final is not None
        c = final.outputs[0]
        row_out = {
            "token_ids": list(c.token_ids),
            "logprobs": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)],
        }
        return row_out, [(s.version, s.start, s.end) for s in c.weight_versions or []]

    async def generate(self, rows: list[list[int]], max_tokens: int, *, one_at_a_time: bool) -> list[dict]:
        """The rows one after another (repeatable bits: no row shares an engine step)."""
        del one_at_a_time  # always one at a time here
        return [(await self._one(r, max_tokens))[0] for r in rows]

    async def generate_versioned(self, row: list[int], max_tokens: int) -> tuple[dict, list]:
        """One request as a client sends it, with vLLM's weight-version spans of its tokens."""
        return await self._one(row, max_tokens)

    async def weight_version(self) -> str:
        return str(await self.engine.get_weight_version())

    def shutdown(self) -> None:
        self.engine.shutdown()
