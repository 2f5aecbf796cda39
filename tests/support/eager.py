"""The test session's `torch.compile` switch, in the environment of every process it starts
(tests/conftest.py) and of the e2e's `vllm serve` pods (tests/e2e/vllm_pods.py)."""

EAGER_HELPERS = {"TORCHDYNAMO_DISABLE": "1"}
"""In the environment of every process the session starts: `torch.compile`d functions run eagerly.
The test engines already run their models eagerly (`enforce_eager`), but vLLM still compiles a few
helpers (the vocab-parallel embedding's mask, the logprob ranks, MoE routing) on each worker's
first forward: Dynamo's tracing, Inductor's cache keys and a C++ build, about 3 CPU-seconds a
worker (measured: a TP 2 `vllm.LLM`'s start and first generation took 51 CPU-s with them and 45
without, its first generation 2.8 s against 0.06 s). Nothing under test is compiled: WeightSync
moves and applies weights, and the engines under test and their oracles (whose cached outputs are
keyed by this setting, reference_cache.environment) run alike. (Megatron-Core compiles nothing
here: its CPU harness turns every fusion off, sync_runtime/engines/megatron_cpu.py.)"""
