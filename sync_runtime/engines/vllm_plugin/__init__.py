"""vLLM plugin: registers the `weightsync` weight-transfer backend.

Declared as a `vllm.general_plugins` entry point (pyproject.toml), so vLLM calls `register` in
every process it starts (API server, engine core, each worker) once WeightSync is installed in
its environment. A vLLM started with `weight_transfer_config={"backend": "weightsync"}` (or
`--weight-transfer-config '{"backend": "weightsync"}'`) then builds `backend.WeightSyncEngine`
in each worker: no `worker_extension_cls`, no WeightSync class in the user's code.

Importing this package imports nothing from vLLM or torch: the backend module is loaded lazily
by vLLM's factory, only in processes that create a weight-transfer engine.
"""

from __future__ import annotations

BACKEND = "weightsync"
BACKEND_MODULE = "sync_runtime.engines.vllm_plugin.backend"
BACKEND_CLASS = "WeightSyncEngine"


def register() -> None:
    """Register the backend with vLLM's WeightTransferEngineFactory (idempotent: vLLM may load
    general plugins more than once in one process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, BACKEND_MODULE, BACKEND_CLASS)
    except ValueError as e:  # "already registered": a repeated load in this process
        if BACKEND not in str(e):
            raise


# Keys of the control store (engines/vllm_ranks.py hosts it; every worker's backend connects):
# per call `seq`, each rank's pickled arguments and answer; at init, each rank's metadata.


def args_key(prefix: str, seq: int, index: int) -> str:
    return f"{prefix}/args/{seq}/{index}"


def answer_key(prefix: str, seq: int, index: int) -> str:
    return f"{prefix}/ans/{seq}/{index}"


def init_key(prefix: str, index: int) -> str:
    return f"{prefix}/init/{index}"
