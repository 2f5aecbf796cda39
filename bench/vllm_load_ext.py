"""Worker extension of bench/vllm_bench.py: WeightSync's own, plus vLLM's full-checkpoint load.

`bench_vllm_load` runs inside every vLLM worker what vLLM itself does to (re)load a model in
place: its default safetensors loader iterates the whole checkpoint of the engine's model dir
(`DefaultModelLoader.get_all_weights`), and the model runner's `reload_weights` pushes it through
`model.load_weights` (each weight loader narrows to this rank's shard) between vLLM's layerwise
reload bookends (materialise, then post-process: CPU GEMM repacking, attention processing).
The engine started with `load_format="dummy"`, whose loader has no `get_all_weights`, so the
route `collective_rpc("reload_weights")` would refuse; the safetensors loader is built here.
"""

from __future__ import annotations

import time
from typing import Any

from sync_runtime.engines.vllm_worker import VllmWorkerExtension

EXTENSION = "bench.vllm_load_ext.LoadBenchExtension"


class LoadBenchExtension(VllmWorkerExtension):
    def bench_vllm_load(self) -> dict[str, float]:
        from vllm.config import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        wall, cpu = time.perf_counter(), time.process_time()
        loader: Any = get_model_loader(LoadConfig(load_format="safetensors"))
        runner.reload_weights(weights_iterator=loader.get_all_weights(model_config, runner.get_model()))
        return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}
