"""The canonical `Manifest` of a config, read from transformers' own model class (design §3).

`AutoModelForCausalLM.from_config` is built under `torch.device("meta")`: no weights are
allocated and nothing is downloaded. Its state dict gives names, shapes and order; tied weights
are found by identity (the output embedding *is* the input embedding) and dropped, as the
checkpoint drops them. core/models/hf_layout.py turns that plain data into the checkpoint's form
(the layout differences are tables there), so core and the planner keep no torch; this module is
the one place that builds the model, at the lowest layer that may import torch and that discovery
(`weightsync plan`, `run`) reaches.

The state of a config is cached by the digest of the fields transformers reads: in memory (unit
tests build the same tiny configs hundreds of times) and on disk per transformers version
(importing torch and transformers and the model's module costs ~10 s on a busy machine, against
~1 s for the rest of `weightsync plan`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
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
    try:
        from transformers import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:  # an install without it: say so in one line, not a traceback
        raise ModelConfigError(f"reading a model's tensors needs transformers>=5 ({e})") from e

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
    # transformers 5.2x checks hidden_size % num_attention_heads == 0 (the rule by which it derives
    # head_dim when none is given) once, when the config is built; with head_dim explicit no weight
    # depends on it (vLLM and Megatron-Core build such models). So build the config with a hidden
    # size that passes that check, then give it the real one: an attribute assignment runs no
    # class validator, and no field is derived from hidden_size when head_dim is given
    # (tests/test_hf_meta.py compares the result field by field).
    config = config_class(**{**fields, "hidden_size": fields["num_attention_heads"] * fields["head_dim"]})
    config.hidden_size = fields["hidden_size"]
    return config


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
_MAX_ON_DISK = 1024
"""Files kept per transformers version; past it the least recently used go (a test run's
property-based configs alone wrote 1,600)."""
_LOCK = threading.Lock()


def _key(config: dict[str, Any]) -> str:
    # Only the fields transformers reads decide the state (weightsync_* keys do not).
    fields = _hf_fields(config) | {"model_type": config.get("model_type")}
    try:
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"model config is not plain JSON data: {e}") from e


def _disk_path(key: str) -> Path | None:
    """The on-disk copy of a config's state, per transformers version: `weightsync plan` then
    imports neither torch nor transformers (~10 s) for a config it has planned before."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    base = Path(os.environ.get("WEIGHTSYNC_CACHE") or Path.home() / ".cache" / "weightsync")
    return base.expanduser() / "hf-state" / f"transformers-{version}" / f"{key}.json"


def _load(path: Path | None) -> MetaState | None:
    if path is None or not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        state = tuple((str(n), tuple(int(x) for x in shape), str(d)) for n, shape, d in raw["state"])
        tied = tuple((str(a), str(b)) for a, b in raw["tied"])
        read = MetaState(str(raw["model_class"]), state, tied, int(raw["parameter_count"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a torn or foreign file: read transformers again and rewrite it
    with contextlib.suppress(OSError):  # a read-only cache is still read
        os.utime(path)  # used now: pruning keeps the recently used
    return read


def _store(path: Path | None, read: MetaState) -> None:
    if path is None:
        return
    body = {"model_class": read.model_class, "state": read.state, "tied": read.tied}
    body["parameter_count"] = read.parameter_count
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(path)  # atomic: concurrent planners never read half a file
        _prune(path.parent)
    except OSError:
        pass  # a read-only cache costs time, never correctness


def _prune(directory: Path) -> None:
    """Keep the _MAX_ON_DISK most recently used files (another process may prune at once)."""
    files = []
    for f in directory.glob("*.json"):
        with contextlib.suppress(OSError):
            files.append((f.stat().st_mtime, f))
    for _, f in sorted(files, key=lambda x: x[0], reverse=True)[_MAX_ON_DISK:]:
        f.unlink(missing_ok=True)


def _cached(key: str) -> MetaState | None:
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    read = _load(_disk_path(key))
    if read is not None:
        _remember(key, read)
    return read


def _remember(key: str, read: MetaState) -> None:
    with _LOCK:
        _CACHE[key] = read
        while len(_CACHE) > _MAX_CACHED:
            _CACHE.popitem(last=False)


def meta_state(config: dict[str, Any]) -> MetaState:
    """transformers' tensors of `config`, cached by the digest of the fields transformers reads (in
    memory, and on disk per transformers version); ModelConfigError, in one line, for a config
    transformers does not know or cannot build."""
    key = _key(config)
    return _cached(key) or _read_and_keep(key, config)


def _read_and_keep(key: str, config: dict[str, Any]) -> MetaState:
    read = _read(config)
    _store(_disk_path(key), read)
    _remember(key, read)
    return read


def build_manifest(config: dict[str, Any]) -> Manifest:
    """The canonical manifest of an HF config dict (see `load_model_config`).

    Raises ModelConfigError (one line) for a config transformers does not know, a family without
    layout rules, missing or unsupported fields, or a `quantization_config`.
    """
    refuse_quantized(config)
    config_dtype(config, DTYPES)  # ours, in one line, before transformers refuses it its own way
    key = _key(config)
    cached = _cached(key)
    if cached is None:
        hf_model_type(config)  # a model transformers does not know is refused as that, first
    dims = model_dims(config)  # the family's layout rules: refuses fields they do not cover
    state = cached if cached is not None else _read_and_keep(key, config)
    return manifest_of(config, dims, state.state, mtp_layers(config))
