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
