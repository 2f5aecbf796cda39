"""Where the `megatron` / `megatron-te` layouts hold DeepSeek-V3's MTP layers (a `Manifest.with_mtp()`):
Megatron-Core 0.19.2's `GPTModel.mtp`, built with `mtp_num_layers` = num_nextn_predict_layers.

Mapping (HF `model.layers.{L+i}.*`, L = num_hidden_layers, i = 0..n-1; `{c}` our `chunk{c}.`
prefix of the last chunk when vpp > 1), all on the last PP stage's last chunk:

    enorm.weight            -> mtp.layers.{i}.enorm.weight             whole
    hnorm.weight            -> mtp.layers.{i}.hnorm.weight             whole
    eh_proj.weight [H, 2H]  -> mtp.layers.{i}.eh_proj.weight [H/t, 2H] rows r-th of t
    shared_head.norm.weight -> mtp.layers.{i}.final_layernorm.weight   whole
    the decoder block       -> mtp.layers.{i}.mtp_model_layer.*        the layout's layer rule
    embed_tokens.weight     -> rows of embedding.word_embeddings.weight (the main embedding)
    shared_head.head.weight -> rows of output_layer.weight (the main output layer; tied: the embedding)

Evidence (megatron-core 0.19.2, paths under megatron/core/):
- models/gpt/gpt_model.py GPTModel.__init__: `self.mtp_process = mtp_block_spec is not None and
  mtp_on_this_rank(...)`, `if self.pre_process or self.mtp_process: self.embedding = ...`,
  `if self.mtp_process: self.mtp = MultiTokenPredictionBlock(...)`.
- transformer/multi_token_prediction.py mtp_on_this_rank: "without custom PP layout, we only
  support put all of MTP layers on the last pipeline stage"; MultiTokenPredictionBlock.__init__
  asserts "MTP layers must be placed on the last virtual pipeline stage". Its `_build_layers`
  makes `self.layers` a ModuleList: `mtp.layers.{i}.` (i from 0).
- MultiTokenPredictionLayer.__init__: `self.enorm`, `self.hnorm`, `self.final_layernorm` (the
  backend's layer norm: `.weight`); `self.eh_proj = build_module(submodules.eh_proj,
  hidden_size * 2, hidden_size, gather_output=False, bias=False, ...)` where
  get_mtp_layer_spec_for_backend sets `eh_proj=backend.column_parallel_linear()`: a
  ColumnParallelLinear, weight [H/t, 2H], output rows r-th of t (`_concat_embeddings` gathers
  its output over TP); `self.mtp_model_layer = build_module(submodules.mtp_model_layer, ...)`,
  which models/gpt/gpt_layer_specs.py get_gpt_mtp_block_spec_for_backend takes from the
  decoder's last layer spec (`spec.layer_specs[-1]`): a TransformerLayer named as the decoder's.
- `_concat_embeddings`: `torch.cat((decoder_input, hidden_states), -1)` with decoder_input =
  enorm(embedding), hidden_states = hnorm(h): eh_proj's columns are [enorm half; hnorm half],
  the HF order (vLLM 0.32 deepseek_mtp.py: `torch.cat([inputs_embeds, previous_hidden_states])`),
  so its columns map whole.
- Shared vocab tensors: GPTModel.forward passes `embedding=self.embedding` to `self.mtp` and
  `output_layer=self.output_layer` to process_mtp_loss; an MTP layer owns neither.
  models/common/language_module/language_module.py setup_embeddings_and_output_layer: "If use
  Multi-Token Prediction (MTP), we also need to maintain duplicated embedding weights in mtp
  process stage" (zeroed, then all-reduced from the first stage; grads all-reduced after).
So a Megatron source holds one embedding and one output layer, which its MTP layers use: the
layout places the MTP layer's `embed_tokens` and `shared_head.head` as second pieces of those
local tensors (same rows, same bytes) and a plan sends the main model's bytes for them, as an
export of the Megatron model writes them. When the MTP chunk is not the first (pp*vpp > 1) it
holds its own copy `embedding.word_embeddings.weight` of the embedding, another sender of
`model.embed_tokens.weight`. Tied embeddings: language_module.shared_embedding_or_output_weight
returns the embedding "During pre processing or MTP process", and GPTModel.forward projects with
it (`output_weight = self.shared_embedding_or_output_weight()`): on an MTP stage that is not the
first, the tied `output_layer.weight` Megatron still allocates is never used (nor synced by it),
so it is declared without pieces and the head is the stage's embedding copy.
A megatron *destination* cannot hold the MTP part (two canonical tensors would write one local
region): refused in one line.
"""

from __future__ import annotations

from sync_runtime.core.layouts import mtp
from sync_runtime.core.layouts._rules import EMBED, ModelView, ShardBuilder, part, require
from sync_runtime.core.manifest import TensorMeta
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.errors import LayoutError

BLOCK = "mtp_model_layer."
"""The MTP layer's decoder block in `mtp.layers.{i}.` (0.19.2: MultiTokenPredictionLayer.mtp_model_layer)."""
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
EH_PROJ = "eh_proj.weight"
WHOLE: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
}
"""MTP-only suffix -> Megatron's name under `mtp.layers.{i}.`, held whole on every TP rank."""
SHARED = {"embed_tokens.weight": EMBEDDING, "shared_head.head.weight": OUTPUT}
"""MTP-only suffix -> the main model's tensor Megatron's MTP layers use for it (tied: OUTPUT is EMBEDDING)."""


def layer_prefix(chunk: str, i: int) -> str:
    """Local name prefix of MTP layer i (0-based within Megatron's MTP block)."""
    return f"{chunk}mtp.layers.{i}."


def check(view: ModelView, spec: ParallelSpec, layout: str, layer_rule: mtp.LayerRule) -> None:
    """The MTP layers have their MTP-only tensors, their blocks are covered, eh_proj splits over TP."""
    mtp.check(view, layout, layer_rule)
    if view.mtp:
        h, t = view.dims.hidden, spec.tp
        subject = view.mtp[0].prefix + EH_PROJ
        require(h % t == 0, layout, subject, f"H={h} not divisible by tp={t} (ColumnParallelLinear rows)")


def refuse_destination(view: ModelView, coord: RankCoord, layout: str) -> None:
    """LayoutError for a destination rank of a manifest with MTP (see the module docstring)."""
    if view.mtp and coord.role is Role.DESTINATION:
        raise LayoutError(
            f"{layout}: {view.mtp[0].prefix}embed_tokens.weight (MTP): Megatron's MTP layers share "
            "the main embedding and output layer; a megatron destination cannot hold the MTP part"
        )


def place(
    out: ShardBuilder,
    view: ModelView,
    layer_rule: mtp.LayerRule,
    chunk: str,
    vocab_padded: int,
    coord: RankCoord,
    spec: ParallelSpec,
    *,
    first_chunk: bool,
    own_output: bool,
) -> None:
    """The MTP layers on the last chunk of the last stage (chunk name prefix `chunk`).

    `first_chunk`: this chunk also holds the model's embedding (pp*vpp == 1), else it gets the
    MTP stage's copy here. `own_output`: untied, the chunk's `output_layer.weight` is the head;
    tied, the head is the chunk's embedding (see the module docstring)."""
    if not view.mtp:
        return
    t, r = spec.tp, coord.tp_rank
    embedding = chunk + EMBEDDING
    if not first_chunk:
        out.vocab_rows(view.top[EMBED], embedding, vocab_padded, t, r)
    shared = {suffix: chunk + local for suffix, local in SHARED.items()}
    if not own_output:
        shared["shared_head.head.weight"] = embedding
    for i, layer in enumerate(view.mtp):
        prefix = layer_prefix(chunk, i)
        inner = mtp.block(layer, prefix + BLOCK)
        layer_rule(out, inner, inner.dense)
        for suffix, local in WHOLE.items():
            out.full(layer.dense[suffix], prefix + local)
        out.split(layer.dense[EH_PROJ], prefix + EH_PROJ, 0, t, r)
        for suffix, local in shared.items():
            _rows_of(out, layer.dense[suffix], local, vocab_padded, t, r)


def _rows_of(out: ShardBuilder, tensor: TensorMeta, local: str, padded: int, t: int, r: int) -> None:
    """A piece of `tensor` in the vocab rows TP rank r holds of the existing local tensor `local`
    (padded rows uncovered), without declaring `local` again."""
    lo, hi = part(padded, t, r)
    top = min(hi, tensor.shape[0])
    if top > lo:
        out.rows_into(tensor, lo, top, local, 0)
