"""Model configs and manifests (design §3).

The manifest of a config comes from transformers' own model class (runtime/hf_manifest.py
builds it on the meta device; hf_layout.py holds the layout tables where the published
checkpoint differs). Families with layout rules: llama (Llama 3, Qwen2, Qwen3), qwen3_moe,
deepseek_v3 (also Kimi-K2), mixtral, glm4_moe, gemma3_text, gpt_oss.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sync_runtime.core.models.config import (
    FAMILIES,
    ModelDims,
    available_presets,
    load_model_config,
    model_dims,
    model_family,
    not_synced,
)
from sync_runtime.core.models.hf_layout import TENSOR_DTYPES_KEY
from sync_runtime.errors import ModelConfigError

if TYPE_CHECKING:
    from sync_runtime.core.manifest import Manifest

_READER = "sync_runtime.runtime.hf_manifest"


def build_manifest(config: dict[str, Any]) -> Manifest:
    """Forwards to `sync_runtime.runtime.hf_manifest.build_manifest`, which needs torch and
    transformers; production modules import that one. Kept for the tests that import it from
    here (a follow-up moves their import lines and deletes this): the import is by name at call
    time so that core itself stays free of torch."""
    reader = importlib.import_module(_READER)
    manifest: Manifest = reader.build_manifest(config)
    return manifest


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
