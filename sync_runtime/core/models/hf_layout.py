"""transformers' tensors of a config -> the canonical `Manifest` (design §3): the pure half.

The names, shapes and order of a model's tensors come from transformers' own model class,
built on the meta device by `sync_runtime.runtime.hf_manifest` and handed here as plain data
(`MetaTensor` tuples in state-dict order, tied duplicates dropped), so core and the planner keep
no torch. What stays hand-written is where the published checkpoint differs from transformers'
in-memory layout, each as a table with a round-trip test (tests/test_hf_meta.py):

- `UNFUSE`: transformers 5 holds routed experts fused (`mlp.experts.gate_up_proj` (E, 2I, H),
  `mlp.experts.down_proj` (E, H, I)); checkpoints store them per expert. Families whose
  checkpoint stores them fused too (`CHECKPOINT_FUSED_EXPERTS`, gpt-oss) are left fused.
- `MOE_CHECKPOINT_NAMES` (config.py): Mixtral's `block_sparse_moe.experts.{e}.w1` names.
- `CHECKPOINT_DTYPES`: tensors the checkpoints store in another dtype than the config's. Every
  other tensor has the config's dtype (transformers upcasts some on load, e.g. DeepSeek-V3's
  router weight, which the checkpoint stores in the config's dtype), then the config's
  `weightsync_tensor_dtypes` overrides, the dtypes a source reports it holds.
- `MTP_ONLY`: DeepSeek-V3's MTP layers (`num_nextn_predict_layers`, part "mtp"), which
  transformers does not build: each is the decoder block of one of the model's own layers of the
  same kind (MoE or dense, by DeepSeek's rule), renamed to index L+k, between the MTP-only tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sync_runtime.core.manifest import DTYPE_BYTES, MTP_PART, Manifest, TensorMeta
from sync_runtime.core.models.config import (
    CHECKPOINT_FUSED_EXPERTS,
    MOE_CHECKPOINT_NAMES,
    ModelDims,
    config_dtype,
)
from sync_runtime.errors import ModelConfigError

MetaTensor = tuple[str, tuple[int, ...], str]
"""(name, shape, dtype name as in torch, e.g. "bfloat16"): one tensor of transformers' model."""

TENSOR_DTYPES_KEY = "weightsync_tensor_dtypes"
"""Config key: {canonical tensor name: dtype} overriding the config's dtype per tensor (not an HF field)."""
CHECKPOINT_DTYPES: dict[str, str] = {"mlp.gate.e_score_correction_bias": "float32"}
"""Name suffix -> the dtype the published checkpoints store it in, whatever the config's dtype
(DeepSeek-V3, Kimi-K2 and GLM-4.5 store the router's e_score_correction_bias F32)."""
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

UNFUSE: dict[str, tuple[tuple[str, int], ...]] = {
    # fused suffix -> ((per-expert suffix, the fraction 1/n of the fused block's rows it takes), ...)
    "mlp.experts.gate_up_proj": (("gate_proj.weight", 2), ("up_proj.weight", 2)),
    "mlp.experts.down_proj": (("down_proj.weight", 1),),
}
"""The split of transformers 5's fused expert tensors into the checkpoint's per-expert ones: each
part takes 1/n of the fused block's rows (gate first, then up), in order."""
EXPERT_ORDER: tuple[str, ...] = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
"""The checkpoint's order of one expert's tensors (the fused block lists all gates+ups, then downs)."""

CHECKPOINT_ORDER: dict[str, tuple[tuple[str, str, str], ...]] = {
    # family -> ((suffix of a layer's tensor, "before" the first / "after" the last, of the layer's
    # tensors starting with this suffix), ...): where the manifest lists a tensor that transformers'
    # module order puts elsewhere (plan digests and the engine tests' reference keys follow it).
    "qwen3_moe": (("mlp.gate.weight", "before", "mlp.experts."),),  # the router before its experts
    "gpt_oss": (("self_attn.sinks", "after", "self_attn.o_proj."),),  # a parameter of the attention
}
"""Moves within a layer from transformers' state-dict order to the manifest's."""
NOT_IN_CHECKPOINT: dict[str, str] = {"mlp.gate.e_score_correction_bias": "expert_bias"}
"""Name suffix -> the `ModelDims` flag without which the checkpoint has no such tensor
(transformers' DeepSeek-V3 router always holds the bias; only `noaux_tc` routing has one)."""

MTP_ONLY: tuple[tuple[str, str, str], ...] = (
    # (suffix after model.layers.{L+k}., before or after the decoder block, shape taken from)
    ("embed_tokens.weight", "before", "embedding"),
    ("enorm.weight", "before", "norm"),
    ("hnorm.weight", "before", "norm"),
    ("eh_proj.weight", "before", "eh_proj"),
    ("shared_head.norm.weight", "after", "norm"),
    ("shared_head.head.weight", "after", "embedding"),
)
"""DeepSeek-V3's MTP-only tensors per MTP layer in checkpoint order: shapes of the embedding
(V, H), of the final norm (H), or eh_proj's (H, 2H) (it projects [enorm(h); hnorm(e)])."""


def unfuse(name: str, shape: tuple[int, ...], dtype: str) -> list[MetaTensor]:
    """One fused expert tensor -> its per-expert checkpoint tensors; any other tensor unchanged."""
    for suffix, parts in UNFUSE.items():
        if not name.endswith(suffix) or len(shape) != 3:
            continue
        base = name[: -len(suffix.split(".")[-1])]
        experts, rows, cols = shape
        return [(f"{base}{e}.{part}", (rows // n, cols), dtype) for e in range(experts) for part, n in parts]
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


def _expert_key(name: str) -> tuple[str, int, int] | None:
    """(block prefix, expert, position in EXPERT_ORDER) of a per-expert tensor, else None."""
    head, sep, rest = name.partition(".experts.")
    expert, _, suffix = rest.partition(".")
    if not sep or not expert.isdigit() or suffix not in EXPERT_ORDER:
        return None
    return head, int(expert), EXPERT_ORDER.index(suffix)


def checkpoint_tensors(state: Iterable[MetaTensor], family: str | None) -> Iterator[MetaTensor]:
    """transformers' state (fused experts, its names) -> the checkpoint's tensors and order:
    experts unfused and listed expert by expert (gate, up, down), Mixtral's names."""
    pending: list[MetaTensor] = []  # the unfused experts of one block, until the block ends

    def flush() -> Iterator[MetaTensor]:
        keyed = sorted(pending, key=lambda t: _expert_key(t[0]) or ("", 0, 0))
        pending.clear()
        yield from ((checkpoint_name(n, family), s, d) for n, s, d in keyed)

    for name, shape, dtype in state:
        if family not in CHECKPOINT_FUSED_EXPERTS and any(name.endswith(s) for s in UNFUSE):
            pending.extend(unfuse(name, shape, dtype))
            continue
        yield from flush()
        yield checkpoint_name(name, family), shape, dtype
    yield from flush()


def _in_checkpoint_order(tensors: list[TensorMeta], family: str) -> list[TensorMeta]:
    """CHECKPOINT_ORDER's moves, layer by layer."""
    moves = CHECKPOINT_ORDER.get(family, ())
    if not moves:
        return tensors
    out: list[TensorMeta] = []
    for index, run in itertools.groupby(tensors, key=lambda t: _layer_index(t.name)):
        group = list(run)
        out.extend(group if index is None else _move(group, f"model.layers.{index}.", moves))
    return out


def _move(layer: list[TensorMeta], prefix: str, moves: tuple[tuple[str, str, str], ...]) -> list[TensorMeta]:
    for suffix, where, anchor in moves:
        moved = [t for t in layer if t.name == prefix + suffix]
        rest = [t for t in layer if t.name != prefix + suffix]
        anchors = [i for i, t in enumerate(rest) if t.name.startswith(prefix + anchor)]
        if not moved or not anchors:
            continue
        at = anchors[0] if where == "before" else anchors[-1] + 1
        layer = rest[:at] + moved + rest[at:]
    return layer


def _layer_index(name: str) -> int | None:
    head, _, rest = name.partition("model.layers.")
    index = rest.partition(".")[0]
    return int(index) if not head and index.isdigit() else None


def mtp_tensors(model: Sequence[TensorMeta], layers: Sequence[tuple[int, bool]]) -> Iterator[TensorMeta]:
    """The MTP part (part MTP_PART) for MTP `layers` [(index L+k, MoE?)]: each one's decoder block is
    the last model layer of the same kind renamed, between the MTP_ONLY tensors."""
    if not layers:
        return
    by_name = {t.name: t for t in model}
    blocks: dict[int, list[TensorMeta]] = {}
    for t in model:
        index = _layer_index(t.name)
        if index is not None:
            blocks.setdefault(index, []).append(t)
    moe = {i: any(".experts." in t.name for t in ts) for i, ts in blocks.items()}
    embedding = by_name["model.embed_tokens.weight"].shape
    norm = by_name["model.norm.weight"].shape
    shapes = {"embedding": embedding, "norm": norm, "eh_proj": (norm[0], 2 * norm[0])}
    for index, is_moe in layers:
        template = [i for i in blocks if moe[i] == is_moe]
        if not template:
            kind = "MoE" if is_moe else "dense"
            raise ModelConfigError(
                f"MTP layer {index} is {kind}, but the model has no {kind} layer to derive it from"
            )
        source, prefix = f"model.layers.{template[-1]}.", f"model.layers.{index}."
        block = [dataclasses.replace(t, name=prefix + t.name[len(source) :]) for t in blocks[template[-1]]]
        only = {
            where: [TensorMeta(prefix + s, shapes[of]) for s, w, of in MTP_ONLY if w == where]
            for where in ("before", "after")
        }
        for t in (*only["before"], *block, *only["after"]):
            yield dataclasses.replace(t, part=MTP_PART)


def manifest_of(
    config: dict[str, Any],
    dims: ModelDims,
    state: Iterable[MetaTensor],
    mtp_layers: Sequence[tuple[int, bool]] = (),
) -> Manifest:
    """The canonical manifest of `config` from transformers' state (see module doc)."""
    dtype = config_dtype(config, DTYPES)
    family = dims.family
    dropped = tuple(suffix for suffix, flag in NOT_IN_CHECKPOINT.items() if not getattr(dims, flag))
    kept = [
        TensorMeta(n, s)
        for n, s, _ in checkpoint_tensors(state, family)
        if not (dropped and n.endswith(dropped))
    ]
    model = tuple(_in_checkpoint_dtype(t, dtype) for t in _in_checkpoint_order(kept, family))
    mtp = tuple(_in_checkpoint_dtype(t, dtype) for t in mtp_tensors(model, mtp_layers))
    both = _with_dtypes(model + mtp, config.get(TENSOR_DTYPES_KEY) or {})
    return Manifest(
        family=family, tensors=both[: len(model)], config=dict(config), dtype=dtype, mtp=both[len(model) :]
    )


def _in_checkpoint_dtype(t: TensorMeta, dtype: str) -> TensorMeta:
    """`t` in the config's dtype, or in the one CHECKPOINT_DTYPES gives its name."""
    for suffix, own in CHECKPOINT_DTYPES.items():
        if t.name.endswith(suffix):
            dtype = own
    return t if t.dtype == dtype else dataclasses.replace(t, dtype=dtype)


def _with_dtypes(tensors: tuple[TensorMeta, ...], dtypes: dict[str, str]) -> tuple[TensorMeta, ...]:
    names = {t.name for t in tensors}
    for name, dtype in dtypes.items():
        if name not in names:
            raise ModelConfigError(f"{TENSOR_DTYPES_KEY}: {name!r} is not a tensor of this model")
        if dtype not in DTYPE_BYTES:
            raise ModelConfigError(
                f"{TENSOR_DTYPES_KEY}: {name}: dtype {dtype!r} unknown (known: {', '.join(DTYPE_BYTES)})"
            )
    return tuple(dataclasses.replace(t, dtype=dtypes[t.name]) if t.name in dtypes else t for t in tensors)
