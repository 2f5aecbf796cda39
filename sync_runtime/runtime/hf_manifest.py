"""The canonical `Manifest` of a config, read from transformers' own model class (design §3).

`AutoModelForCausalLM.from_config` is built under `torch.device("meta")`: no weights are
allocated and nothing is downloaded. Its state dict gives names, shapes and order; tied weights
are found by identity (the output embedding *is* the input embedding) and dropped, as the
checkpoint drops them. core/models/hf_layout.py turns that plain data into the checkpoint's form
(the layout differences are tables there), so core and the planner keep no torch; this module is
the one place that builds the model, at the lowest layer that may import torch and that discovery
(`weightsync plan`, `run`) reaches.

The state of a config is cached by the digest of the fields transformers reads (the meta build
costs ~0.1-1 s per config; unit tests build the same tiny configs hundreds of times).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models.config import config_dtype, model_dims, mtp_layers, refuse_quantized
from sync_runtime.core.models.hf_layout import DTYPES, MetaTensor, checkpoint_tensors, manifest_of
from sync_runtime.errors import ModelConfigError


@dataclass(frozen=True, slots=True)
class MetaState:
    """What transformers' model class holds for a config, as plain data."""

    model_class: str
    state: tuple[MetaTensor, ...]
    """transformers' own tensors (its names, experts fused), state-dict order, tied duplicates dropped."""
    tied: tuple[tuple[str, str], ...]
    """(dropped name, the name it shares storage with), e.g. lm_head -> embed_tokens."""
    parameter_count: int
    """sum(p.numel() for p in model.parameters()): transformers' own count (ties counted once)."""

    def checkpoint_form(self, family: str | None) -> tuple[MetaTensor, ...]:
        """The state in the checkpoint's form (hf_layout.checkpoint_tensors)."""
        return tuple(checkpoint_tensors(self.state, family))


def hf_model_type(config: dict[str, Any]) -> str:
    """The transformers model type of `config`: its `model_type`, else the one whose causal-LM
    class is `architectures[0]` (Kimi-K2 says `kimi_k2` but is a DeepseekV3ForCausalLM)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type in CONFIG_MAPPING and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return str(model_type)
    by_class = {cls: mt for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    for arch in config.get("architectures") or []:
        if arch in by_class and by_class[arch] in CONFIG_MAPPING:
            return by_class[arch]
    raise ModelConfigError(
        f"model_type={model_type!r}, architectures={config.get('architectures')!r}: "
        "not a causal language model transformers knows"
    )


def _hf_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "model_type" and not k.startswith("weightsync_")}


def _hf_config(model_type: str, fields: dict[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    try:
        return config_class(**fields)
    except Exception as e:
        if "validate_architecture" not in str(e) or fields.get("head_dim") is None:
            raise
    # transformers 5.2x checks hidden_size % num_attention_heads == 0, the rule by which it derives
    # head_dim when none is given; with head_dim explicit no weight depends on it (vLLM and
    # Megatron-Core build such models), so build the config without that one check.
    validators = config_class.__class_validators__
    config_class.__class_validators__ = [v for v in validators if v.__name__ != "validate_architecture"]
    try:
        return config_class(**fields)
    finally:
        config_class.__class_validators__ = validators


def _build_meta(config: dict[str, Any], model_type: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    # transformers warns about rope and generation fields; the manifest does not depend on them.
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            hf_config = _hf_config(model_type, _hf_fields(config))
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(hf_config)
        except Exception as e:  # transformers' own refusal of a field, whatever its type: one line
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelConfigError(f"model_type={model_type!r}: transformers cannot build it: {first}") from e


def _read(config: dict[str, Any]) -> MetaState:
    model = _build_meta(config, hf_model_type(config))
    tied: list[tuple[str, str]] = []
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        tied.append(("lm_head.weight", "model.embed_tokens.weight"))
    dropped = {name for name, _ in tied}
    state = tuple(
        (name, tuple(value.shape), str(value.dtype).removeprefix("torch."))
        for name, value in model.state_dict().items()
        if name not in dropped
    )
    count = sum(p.numel() for p in model.parameters())
    return MetaState(type(model).__name__, state, tuple(tied), count)


_CACHE: OrderedDict[str, MetaState] = OrderedDict()
_MAX_CACHED = 64
_LOCK = threading.Lock()


def meta_state(config: dict[str, Any]) -> MetaState:
    """transformers' tensors of `config` (cached by the digest of the fields transformers reads;
    weightsync_* keys do not change them); ModelConfigError, in one line, for a config
    transformers does not know or cannot build."""
    fields = _hf_fields(config) | {"model_type": config.get("model_type")}
    try:
        key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"model config is not plain JSON data: {e}") from e
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    read = _read(config)
    with _LOCK:
        _CACHE[key] = read
        while len(_CACHE) > _MAX_CACHED:
            _CACHE.popitem(last=False)
    return read


def build_manifest(config: dict[str, Any]) -> Manifest:
    """The canonical manifest of an HF config dict (see `load_model_config`).

    Raises ModelConfigError (one line) for a config transformers does not know, a family without
    layout rules, missing or unsupported fields, or a `quantization_config`.
    """
    refuse_quantized(config)
    config_dtype(config, DTYPES)  # ours, in one line, before transformers refuses it its own way
    hf_model_type(config)  # a model transformers does not know is refused as that, first
    dims = model_dims(config)  # the family's layout rules: refuses fields they do not cover
    return manifest_of(config, dims, meta_state(config).state, mtp_layers(config))
