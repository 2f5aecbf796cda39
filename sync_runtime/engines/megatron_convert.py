"""Megatron-Core shards -> canonical Hugging Face tensors, from Megatron's own split attributes.

The converter is deliberately independent of the layouts: it reassembles full tensors from each
parameter's `partition_dim` / `partition_stride` and its TP (or expert-TP) rank, then renames
them the way the logits test proved against transformers (TP 1, fp32). The demo and the tests
check what a sync delivered against its output, so a wrong layout rule cannot hide behind itself.
MTP layers (`mtp.layers.{i}.*`) become `model.layers.{L+i}.*`; their `embed_tokens` and
`shared_head.head` are the main embedding and output layer, which Megatron-Core's MTP layers use
(GPTModel.forward passes `self.embedding` and `self.output_layer` to them).
gpt-oss: the per-expert tensors are stacked into the checkpoint's fused ones here, with torch.stack
on a new last dim (gate, up) for the interleaving, written apart from the layout's reorientation
table (layouts/megatron_gpt_oss.py) so that a wrong table cannot agree with itself.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sync_runtime.core.models import model_dims
from sync_runtime.core.models.config import MOE_CHECKPOINT_NAMES
from sync_runtime.engines.megatron_names import LiveTensor


@dataclass(frozen=True, slots=True)
class ExportedShard:
    """A copy of one live tensor with what is needed to put it back together."""

    global_name: str
    tensor: torch.Tensor
    partition_dim: int | None
    partition_stride: int
    group_rank: int
    group_size: int


_UNMARKED_TP_SPLITS = {"self_attention.core_attention.softmax_offset": 0}
"""Parameters split over TP that Megatron-Core does not mark `tensor_model_parallel` (the
learnable softmax offset holds the rank's heads: DotProductAttention sizes it by
num_attention_heads_per_partition; its sharded_state_dict splits it on dim 0)."""


def export_shards(live: Iterable[LiveTensor]) -> list[ExportedShard]:
    """This rank's tensors as copies (to ship to a driver); TP or expert-TP rank from Megatron."""
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    out = []
    for t in live:
        unmarked = next((d for s, d in _UNMARKED_TP_SPLITS.items() if t.global_name.endswith(s)), None)
        dim = t.partition_dim if unmarked is None else unmarked
        group = etp if t.expert else tp
        out.append(ExportedShard(t.global_name, t.tensor.detach().clone(), dim, t.partition_stride, *group))
    return out


def _join(parts: list[ExportedShard]) -> torch.Tensor:
    """Full tensor from one shard per group rank; stride s: each shard is s interleaved blocks."""
    first = parts[0]
    if first.partition_dim is None:
        return first.tensor
    dim, s = first.partition_dim, first.partition_stride
    pieces = [p.tensor.chunk(s, dim=dim) for p in parts]
    return torch.cat([pieces[r][j] for j in range(s) for r in range(len(parts))], dim=dim)


def gather_full(exports: Iterable[Iterable[ExportedShard]]) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (global names) from every source rank's exports (replicas dropped)."""
    by_name: dict[str, dict[int, ExportedShard]] = defaultdict(dict)
    for rank_exports in exports:
        for e in rank_exports:
            by_name[e.global_name].setdefault(e.group_rank if e.partition_dim is not None else 0, e)
    out = {}
    for name, by_rank in by_name.items():
        size = (
            next(iter(by_rank.values())).group_size
            if next(iter(by_rank.values())).partition_dim is not None
            else 1
        )
        if sorted(by_rank) != list(range(size)):
            raise ValueError(f"{name}: shards of group ranks {sorted(by_rank)}, expected 0..{size - 1}")
        out[name] = _join([by_rank[r] for r in range(size)])
    return out


_ATTN = {  # Megatron attention suffix (local spec, then TE) -> HF suffix
    "linear_proj.weight": "o_proj.weight",
    "linear_proj.bias": "o_proj.bias",
    "core_attention.softmax_offset": "sinks",
    "q_layernorm.weight": "q_norm.weight",
    "k_layernorm.weight": "k_norm.weight",
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_q_proj.weight": "q_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_q_up_proj.layer_norm_weight": "q_a_layernorm.weight",
    "linear_kv_up_proj.layer_norm_weight": "kv_a_layernorm.weight",
}
# MLA has no q_norm: under the local spec its q_layernorm is the q_a_layernorm.
_ATTN_MLA = {**_ATTN, "q_layernorm.weight": "q_a_layernorm.weight"}
_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.bias": "mlp.gate.bias",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}


# GPTModel.mtp's layers (layouts/megatron_mtp.py): MTP-only tensors -> HF suffix; the block is a layer.
_MTP = re.compile(r"^mtp\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
# Dense MLP and shared experts: linear_fc{1,2}.{weight,bias} (biases: Llama's mlp_bias).
_DENSE_FC = re.compile(r"^(?P<block>mlp\.(?:shared_experts\.)?)(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)$")
# A routed expert's tensor: local spec `local_experts.{e}.linear_fc{1,2}.{weight,bias}`, or TE grouped
# `linear_fc{1,2}.{weight,bias}{e}`.
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)"
    r"|(?P<te_fc>linear_fc[12])\.(?P<te_kind>weight|bias)(?P<te>\d+))$"
)
# A routed MoE block's tensors in the Qwen/DeepSeek form the rules above produce.
_MOE_TENSOR = re.compile(r"^(?P<layer>model\.layers\.\d+\.)mlp\.(?P<rest>gate\.weight|experts\.\d+\..+)$")


def _mlp(
    out: dict[str, torch.Tensor],
    hf: str,
    fc1: torch.Tensor | None,
    fc2: torch.Tensor | None,
    kind: str = "weight",
) -> None:
    """fc1 = [gate; up] rows (weight or, with Llama's mlp_bias, bias), fc2 = down."""
    if fc1 is not None:
        out[f"{hf}gate_proj.{kind}"], out[f"{hf}up_proj.{kind}"] = fc1.chunk(2, dim=0)
    if fc2 is not None:
        out[f"{hf}down_proj.{kind}"] = fc2


def _layer_tensor(
    out: dict[str, torch.Tensor], h: str, rest: str, t: torch.Tensor, qkv: Any, mla: bool
) -> None:
    attn = _ATTN_MLA if mla else _ATTN
    if rest in _NORMS:
        out[h + _NORMS[rest]] = t
    elif rest.startswith("self_attention.") and rest.removeprefix("self_attention.") in attn:
        out[h + "self_attn." + attn[rest.removeprefix("self_attention.")]] = t
    elif rest == "self_attention.linear_qkv.weight" or rest == "self_attention.linear_qkv.bias":
        kind = rest.rpartition(".")[2]
        for x, part in zip("qkv", qkv(t), strict=True):
            out[f"{h}self_attn.{x}_proj.{kind}"] = part
    elif (m := _DENSE_FC.match(rest)) is not None:
        fc1 = t if m["fc"] == "linear_fc1" else None
        _mlp(out, h + m["block"], fc1, None if fc1 is not None else t, m["kind"])
    elif (m := _EXPERT.match(rest)) is not None:  # local spec, or TE grouped
        e, fc, kind = m["e"] or m["te"], m["fc"] or m["te_fc"], m["kind"] or m["te_kind"]
        fc1 = t if fc == "linear_fc1" else None
        _mlp(out, f"{h}mlp.experts.{e}.", fc1, None if fc1 is not None else t, kind)
    else:
        raise ValueError(f"decoder layer tensor {rest!r}: no HF counterpart known")


def to_hf(full: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical HF checkpoint tensors (per-expert names) from full Megatron tensors."""
    d = model_dims(dict(hf_config))
    per, hd = (d.num_heads // d.num_kv_heads, d.head_dim) if not d.mla else (1, 0)

    def qkv(w: torch.Tensor) -> list[torch.Tensor]:
        grouped = w.reshape(d.num_kv_heads, (per + 2) * hd, *w.shape[1:])
        return [p.reshape(-1, *w.shape[1:]) for p in grouped.split([per * hd, hd, hd], dim=1)]

    out: dict[str, torch.Tensor] = {}
    mtp_layers: set[int] = set()
    for name, t in full.items():
        if (m := _MTP.match(name)) is not None:
            i, rest = int(m["i"]), m["rest"]
            mtp_layers.add(i)
            h = f"model.layers.{d.num_layers + i}."
            if rest.startswith("mtp_model_layer."):
                _layer_tensor(out, h, rest.removeprefix("mtp_model_layer."), t, qkv, d.mla)
            elif rest in _MTP_OWN:
                out[h + _MTP_OWN[rest]] = t
            else:
                raise ValueError(f"{name!r}: no HF counterpart known")
        elif name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[: d.vocab]
        elif name == "output_layer.weight":
            if not d.tie_embeddings:  # tied: a copy of the embedding, not a tensor of its own
                out["lm_head.weight"] = t[: d.vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name.startswith("decoder.layers."):
            index, _, rest = name.removeprefix("decoder.layers.").partition(".")
            _layer_tensor(out, f"model.layers.{index}.", rest, t, qkv, d.mla)
        else:
            raise ValueError(f"{name!r}: no HF counterpart known")
    for i in sorted(mtp_layers):  # Megatron's MTP layers use the main embedding and output layer
        h = f"model.layers.{d.num_layers + i}."
        out[h + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[h + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    if d.fused_experts:
        return _fused_experts(out, d.num_layers + len(mtp_layers), d.num_experts)
    return _checkpoint_moe_names(out, d.family)


def _fused_experts(out: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """gpt-oss's checkpoint form: per layer, experts stacked into gate_up_proj (E, H, 2Im) with
    gate/up interleaved on the last dim (gate = [..., 0::2]), gate_up_proj_bias (E, 2Im),
    down_proj (E, Im, H) = the transposed down weights, down_proj_bias (E, H); the router keeps
    gpt-oss's name `mlp.router`."""
    fused = dict(out)
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        if f"{p}experts.0.gate_proj.weight" not in out:
            continue
        per = [{k: fused.pop(f"{p}experts.{e}.{k}") for k in _EXPERT_KEYS} for e in range(experts)]
        pairs = [torch.stack([x["gate_proj.weight"].T, x["up_proj.weight"].T], dim=-1) for x in per]
        fused[f"{p}experts.gate_up_proj"] = torch.stack([w.flatten(-2) for w in pairs])
        bias = [torch.stack([x["gate_proj.bias"], x["up_proj.bias"]], dim=-1).flatten() for x in per]
        fused[f"{p}experts.gate_up_proj_bias"] = torch.stack(bias)
        fused[f"{p}experts.down_proj"] = torch.stack([x["down_proj.weight"].T for x in per]).contiguous()
        fused[f"{p}experts.down_proj_bias"] = torch.stack([x["down_proj.bias"] for x in per])
        for kind in ("weight", "bias"):
            fused[f"{p}router.{kind}"] = fused.pop(f"{p}gate.{kind}")
    return fused


_EXPERT_KEYS = tuple(f"{x}_proj.{k}" for x in ("gate", "up", "down") for k in ("weight", "bias"))


def _checkpoint_moe_names(out: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """Routed MoE tensors under the family's own checkpoint names (MOE_CHECKPOINT_NAMES, the
    table the manifest uses: Mixtral's `block_sparse_moe.gate`, `experts.{e}.w1` = gate_proj...)."""
    if family not in MOE_CHECKPOINT_NAMES:
        return out
    block, own = MOE_CHECKPOINT_NAMES[family]
    suffix = {canon: ckpt for ckpt, canon in own.items()}
    renamed = {}
    for name, t in out.items():
        m = _MOE_TENSOR.match(name)
        if m is not None:
            tail = m["rest"]
            if tail != "gate.weight":  # experts.{e}.{canonical suffix}
                _, e, canon = tail.split(".", 2)
                tail = f"experts.{e}.{suffix[canon]}"
            name = f"{m['layer']}{block}{tail}"
        renamed[name] = t
    return renamed
