"""The canonical tensors of a config read from transformers' own model class on the meta device.

No weights are allocated and nothing is downloaded: `AutoModelForCausalLM.from_config` is
built under `torch.device("meta")` and its state dict gives names, shapes and dtypes; tied
weights are found by identity (the output embedding *is* the input embedding). This lives
outside `core` because core and the planner stay free of torch; what it returns is plain data
(`MetaTensor` tuples) that core compares against or builds a `Manifest` from.

transformers 5 holds routed experts fused (`mlp.experts.gate_up_proj` of shape (E, 2I, H),
`mlp.experts.down_proj` of shape (E, H, I)) and converts published checkpoints on load; the
canonical manifest keeps the checkpoint's per-expert tensors. `UNFUSE` is that one layout
difference, as a table: fused suffix -> the per-expert tensors it splits into along dim 1.
Families whose checkpoint stores the experts fused too (`CHECKPOINT_FUSED_EXPERTS`, gpt-oss,
whose fused tensors are (E, H, 2I) with gate/up interleaved and carry biases) are not unfused.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

from sync_runtime.core.models.config import CHECKPOINT_FUSED_EXPERTS, MOE_CHECKPOINT_NAMES, model_family
from sync_runtime.errors import ModelConfigError

MetaTensor = tuple[str, tuple[int, ...], str]
"""(name, shape, dtype name as in torch, e.g. "bfloat16")."""

UNFUSE: dict[str, tuple[tuple[str, int], ...]] = {
    # fused suffix -> ((per-expert suffix, rows of the fused per-expert block it takes), ...);
    # rows 0 means "all of them" (down_proj is stored per expert as it is fused).
    "mlp.experts.gate_up_proj": (("gate_proj.weight", 2), ("up_proj.weight", 2)),
    "mlp.experts.down_proj": (("down_proj.weight", 1),),
}
"""The split of transformers 5's fused expert tensors into the checkpoint's per-expert ones:
each part takes 1/n of the fused block's rows (gate first, then up), in order."""


@dataclass(frozen=True, slots=True)
class MetaManifest:
    model_class: str
    tensors: tuple[MetaTensor, ...]
    """Checkpoint-form tensors (experts unfused), in state-dict order, tied duplicates dropped."""
    tied: tuple[tuple[str, str], ...]
    """(dropped name, the name it shares storage with), e.g. lm_head -> embed_tokens."""
    parameter_count: int
    """sum(p.numel() for p in model.parameters()): transformers' own count (ties counted once)."""


def unfuse(name: str, shape: tuple[int, ...], dtype: str) -> list[MetaTensor]:
    """One fused expert tensor -> its per-expert checkpoint tensors; any other tensor unchanged."""
    for suffix, parts in UNFUSE.items():
        if not name.endswith(suffix) or len(shape) != 3:
            continue
        base = name[: -len(suffix.split(".")[-1])]
        experts, rows, cols = shape
        out: list[MetaTensor] = []
        for e in range(experts):
            for part_suffix, n in parts:
                out.append((f"{base}{e}.{part_suffix}", (rows // n, cols), dtype))
        return out
    return [(name, shape, dtype)]


def checkpoint_name(name: str, family: str | None) -> str:
    """transformers' (converted) name -> the checkpoint's, for families in MOE_CHECKPOINT_NAMES
    (transformers 5 loads Mixtral's block_sparse_moe.experts.{e}.w1 as mlp.experts...)."""
    if family not in MOE_CHECKPOINT_NAMES or ".mlp." not in name:
        return name
    block, names = MOE_CHECKPOINT_NAMES[family]
    head, _, rest = name.partition(".mlp.")
    if not rest.startswith(("gate.", "experts.")):
        return name
    for own, canon in names.items():
        if rest.endswith("." + canon):
            rest = rest[: -len(canon)] + own
            break
    return f"{head}.{block}{rest}"


def _family(config: dict[str, Any]) -> str | None:
    try:
        return model_family(config)
    except ModelConfigError:
        return None


def hf_model_type(config: dict[str, Any]) -> str:
    """The transformers model type of `config`: its `model_type`, else the one whose causal-LM
    class is `architectures[0]` (Kimi-K2 says `kimi_k2` but is a DeepseekV3ForCausalLM)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type in CONFIG_MAPPING:
        return str(model_type)
    by_class = {cls: mt for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    for arch in config.get("architectures") or []:
        if arch in by_class and by_class[arch] in CONFIG_MAPPING:
            return by_class[arch]
    raise ModelConfigError(
        f"model_type={model_type!r}, architectures={config.get('architectures')!r}: "
        "not a model transformers knows"
    )


def _build_meta(config: dict[str, Any], model_type: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type" and not k.startswith("weightsync_")}
    # transformers warns about rope and generation fields; the manifest does not depend on them.
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(hf_config)
            except ValueError as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ModelConfigError(f"model_type={model_type!r}: {first}") from e


def meta_manifest(config: dict[str, Any]) -> MetaManifest:
    """The checkpoint-form tensors of `config` per transformers; ModelConfigError if it does not know it."""
    model = _build_meta(config, hf_model_type(config))
    tied: list[tuple[str, str]] = []
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is not None and out_emb.weight is in_emb.weight:
        tied.append(("lm_head.weight", "model.embed_tokens.weight"))
    dropped = {name for name, _ in tied}
    family = _family(config)
    tensors: list[MetaTensor] = []
    for name, value in model.state_dict().items():
        if name in dropped:
            continue
        dtype = str(value.dtype).removeprefix("torch.")
        if family in CHECKPOINT_FUSED_EXPERTS:
            tensors.append((name, tuple(value.shape), dtype))
            continue
        for part_name, shape, part_dtype in unfuse(name, tuple(value.shape), dtype):
            tensors.append((checkpoint_name(part_name, family), shape, part_dtype))
    count = sum(p.numel() for p in model.parameters())
    return MetaManifest(type(model).__name__, tuple(tensors), tuple(tied), count)
