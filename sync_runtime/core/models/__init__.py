"""Model manifests from config.json (design §3).

Families: llama (Llama 3, Qwen2, Qwen3), qwen3_moe, deepseek_v3 (also Kimi-K2), mixtral.
"""

from sync_runtime.core.models.builders import TENSOR_DTYPES_KEY, build_manifest
from sync_runtime.core.models.config import (
    FAMILIES,
    ModelDims,
    available_presets,
    load_model_config,
    model_dims,
    model_family,
    not_synced,
)
from sync_runtime.errors import ModelConfigError

__all__ = [
    "FAMILIES",
    "TENSOR_DTYPES_KEY",
    "ModelConfigError",
    "ModelDims",
    "available_presets",
    "build_manifest",
    "load_model_config",
    "model_dims",
    "model_family",
    "not_synced",
]
