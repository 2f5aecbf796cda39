"""Where the layouts that place MTP layers (`hf`, `vllm`) put them (a `Manifest.with_mtp()`).

An MTP layer (DeepSeek-V3's `model.layers.{L}.*`, L = num_hidden_layers) is the tensors only an
MTP layer has (MTP_ONLY) plus a decoder layer ("block") of the same form as any other; the block
is placed by the layout's own layer rule under a prefix of the layout's choosing, the MTP-only
tensors here. Both live on the last PP stage (where the drafter runs: it reads the last
hidden states). TP: `embed_tokens` and `shared_head.head` rows over the vocab padded as the
layout pads, where the layout holds them at all (`hf`); `enorm`, `hnorm`, `shared_head.norm`
and `eh_proj` whole on every rank (vLLM 0.32's DeepSeekMultiTokenPredictorLayer holds eh_proj
as a plain nn.Linear, replicated). vLLM 0.32 holds no `embed_tokens` or `shared_head.head` of
an MTP drafter: its proposer always replaces them by the target's `embed_tokens` and `lm_head`
(llm_base_proposer.py, "Detected MTP model. Sharing target model ... weights"; seen in an
engine's log), so the `vllm` layout leaves them out (SHARED_WITH_TARGET) and is not sent them.
"""

from __future__ import annotations

from collections.abc import Callable

from sync_runtime.core.layouts._rules import LayerView, ModelView, ShardBuilder, TrackingDict
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.errors import LayoutError

VOCAB_ROWS = ("embed_tokens.weight", "shared_head.head.weight")
WHOLE = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_ONLY = frozenset(VOCAB_ROWS + WHOLE)
SHARED_WITH_TARGET = VOCAB_ROWS
"""The MTP-only suffixes a layout that shares them with the target model holds no copy of."""

LayerRule = Callable[[ShardBuilder, LayerView, dict[str, TensorMeta]], None]
Names = Callable[[LayerView, str], str]
"""(MTP layer, MTP-only suffix) -> the local name the layout holds it under."""


def block(layer: LayerView, prefix: str) -> LayerView:
    """The decoder layer of an MTP layer, under the local name prefix `prefix`."""
    dense = {s: t for s, t in layer.dense.items() if s not in MTP_ONLY}
    return LayerView(layer.index, prefix, dense, layer.experts)


def place(
    out: ShardBuilder,
    view: ModelView,
    layer_rule: LayerRule,
    block_prefix: Callable[[LayerView], str],
    names: Names,
    vocab_rows: Callable[[TensorMeta, str], None] | None,
) -> None:
    """Every MTP layer of `view`: its block by `layer_rule`, its MTP-only tensors by the rules
    above; `vocab_rows` None: the layout shares those with the target (SHARED_WITH_TARGET)."""
    for layer in view.mtp:
        inner = block(layer, block_prefix(layer))
        layer_rule(out, inner, inner.dense)
        for suffix in VOCAB_ROWS if vocab_rows is not None else ():
            vocab_rows(layer.dense[suffix], names(layer, suffix))
        for suffix in WHOLE:
            out.full(layer.dense[suffix], names(layer, suffix))


def check(view: ModelView, layout: str, layer_rule: LayerRule) -> None:
    """Every MTP layer has its MTP-only tensors and its block's every tensor is read by `layer_rule`."""
    for layer in view.mtp:
        missing = sorted(MTP_ONLY - set(layer.dense))
        if missing:
            raise LayoutError(f"{layout}: {layer.prefix}*: an MTP layer without {missing}")
        inner = block(layer, layer.prefix)
        tracked = TrackingDict(inner.dense)
        layer_rule(ShardBuilder(), inner, tracked)
        for name in sorted(set(inner.dense) - tracked.read):
            raise LayoutError(f"{layout}: {layer.prefix}{name}: no rule of this layout covers the tensor")
