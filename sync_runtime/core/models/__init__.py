"""Model configs and manifests (design §3).

The manifest of a config comes from transformers' own model class: `build_manifest` in
runtime/hf_manifest.py builds it on the meta device (core stays free of torch), and
hf_layout.py holds the layout tables where the published checkpoint differs. Families with
layout rules: llama (Llama 3, Qwen2, Qwen3), qwen3_moe, deepseek_v3 (also Kimi-K2), mixtral,
glm4_moe, gemma3_text, gpt_oss.
"""

from __future__ import annotations

from sync_runtime.core.models.config import (
    ModelDims,
    available_presets,
    load_model_config,
    model_dims,
    not_synced,
)
from sync_runtime.core.models.families import FAMILIES, model_family
from sync_runtime.core.models.hf_layout import TENSOR_DTYPES_KEY
from sync_runtime.errors import ModelConfigError

__all__ = [
    "FAMILIES",
    "TENSOR_DTYPES_KEY",
    "ModelConfigError",
    "ModelDims",
    "available_presets",
    "load_model_config",
    "model_dims",
    "model_family",
    "not_synced",
]
