"""Reading a model's config.json into typed dimensions (design §3).

`ModelDims` is the one place that interprets config fields for the layouts' sharding rules (and
the manifest's layout tables); the tensors themselves come from transformers' model class
(runtime/hf_manifest.py), and a config whose fields the rules do not cover is refused here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sync_runtime.core.models.families import model_family
from sync_runtime.errors import ModelConfigError

PRESET_DIR = Path(__file__).resolve().parent / "presets"

CHECKPOINT_FUSED_EXPERTS: frozenset[str] = frozenset({"gpt_oss"})
"""Families whose checkpoint itself stores routed experts fused (gpt-oss: `mlp.experts.gate_up_proj`
(E, H, 2Im) with gate and up interleaved on the last dim, `down_proj` (E, Im, H), and their biases)."""

MOE_CHECKPOINT_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    # family -> (its MoE block's module name, {per-expert checkpoint suffix: canonical suffix}).
    # Layouts see every family's MoE tensors under `mlp.` and gate/up/down; the manifest keeps
    # the checkpoint's own names (Mixtral: block_sparse_moe.experts.{e}.w1 = gate, w3 = up, w2 = down).
    "mixtral": (
        "block_sparse_moe.",
        {"w1.weight": "gate_proj.weight", "w3.weight": "up_proj.weight", "w2.weight": "down_proj.weight"},
    ),
}
"""Checkpoint names of MoE blocks that differ from the Qwen/DeepSeek form (`mlp.experts.{e}.gate_proj`)."""


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_model_config(preset_name_or_path: str | Path) -> dict[str, Any]:
    """A preset name (`sync_runtime/presets/<name>.json`), an HF config.json, or a model directory
    holding one (what `save_pretrained` writes and a hub snapshot is)."""
    text = str(preset_name_or_path)
    preset = PRESET_DIR / f"{text}.json"
    path = preset if preset.is_file() else Path(text)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{text}: a directory without config.json")
    if not path.is_file():
        raise ModelConfigError(
            f"{text!r} is neither a preset ({', '.join(available_presets())}), a config.json file "
            "nor a model directory"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDims:
    """The dimensions of a supported model, named as in design §3's notation."""

    family: str
    model_type: str
    hidden: int
    """H."""
    vocab: int
    """V (unpadded, as in the checkpoint)."""
    num_layers: int
    """L, decoder layers synced (MTP layers excluded)."""
    num_heads: int
    """nh."""
    num_kv_heads: int
    """nkv (equal to nh for MLA, where K/V are per head after kv_b_proj)."""
    head_dim: int
    """d for GQA attention; qk_nope + qk_rope for MLA."""
    intermediate: int
    """I of dense MLP layers."""
    tie_embeddings: bool
    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    qk_norm: bool = False
    """Per-head q_norm/k_norm (Qwen3)."""
    mlp_bias: bool = False
    """Dense MLP gate/up/down projections have biases (Llama's `mlp_bias`)."""
    sandwich_norms: bool = False
    """pre_feedforward_layernorm and post_feedforward_layernorm around the MLP (Gemma 3)."""
    o_bias: bool = False
    """o_proj has a bias too (gpt-oss's attention_bias covers all four projections)."""
    attn_sinks: bool = False
    """Per-head learned attention sinks `self_attn.sinks` [nh] (gpt-oss)."""
    fused_experts: bool = False
    """Routed experts stored fused in the checkpoint (CHECKPOINT_FUSED_EXPERTS), with biases."""
    num_experts: int = 0
    """E routed experts (0 for dense models)."""
    moe_intermediate: int = 0
    """Im, per routed expert."""
    shared_intermediate: int = 0
    """Intermediate size of the shared-expert MLP (Im * n_shared_experts), 0 if none."""
    moe_layers: frozenset[int] = frozenset()
    """Indices of the layers whose MLP is a routed MoE."""
    expert_bias: bool = False
    """Router has `e_score_correction_bias` (DeepSeek-V3 noaux_tc routing)."""
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    """> 0 means MLA attention."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


def _req(config: dict[str, Any], field: str) -> Any:
    if config.get(field) is None:
        raise ModelConfigError(f"{config.get('model_type')}: config field {field!r} is missing")
    return config[field]


def _pos_int(config: dict[str, Any], field: str) -> int:
    value = _req(config, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError(
            f"{config.get('model_type')}: config field {field!r}={value!r} must be an int >= 1"
        )
    return value


def _refuse_flag(config: dict[str, Any], field: str) -> None:
    # o_proj / MLP biases would need row-parallel bias rules no layout of design §4 defines.
    if config.get(field):
        raise ModelConfigError(f"{config.get('model_type')}: {field}=true is not supported (no layout rule)")


def _common(config: dict[str, Any], family: str) -> dict[str, Any]:
    hidden = _pos_int(config, "hidden_size")
    heads = _pos_int(config, "num_attention_heads")
    return {
        "family": family,
        "model_type": str(config.get("model_type", family)),
        "hidden": hidden,
        "vocab": _pos_int(config, "vocab_size"),
        "num_layers": _pos_int(config, "num_hidden_layers"),
        "num_heads": heads,
        "intermediate": _pos_int(config, "intermediate_size"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def _gqa(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    nkv = config.get("num_key_value_heads") or base["num_heads"]
    head_dim = config.get("head_dim") or base["hidden"] // base["num_heads"]
    _refuse_flag(config, "attention_bias")
    model_type = base["model_type"]
    if model_type != "llama":  # only LlamaMLP reads mlp_bias
        _refuse_flag(config, "mlp_bias")
    return {
        **base,
        "num_kv_heads": int(nkv),
        "head_dim": int(head_dim),
        "qkv_bias": model_type == "qwen2",
        "qk_norm": model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        "sandwich_norms": model_type == "gemma3_text",
        "mlp_bias": model_type == "llama" and bool(config.get("mlp_bias")),
    }


def _qwen3_moe(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    dims = _gqa(config, base)
    experts = _pos_int(config, "num_experts")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    moe = frozenset(i for i in range(base["num_layers"]) if i not in dense and (i + 1) % step == 0)
    return {
        **dims,
        "num_experts": experts,
        "moe_intermediate": _pos_int(config, "moe_intermediate_size"),
        "moe_layers": moe,
    }


def _mixtral(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    # Every layer is MoE; intermediate_size is the per-expert size; no shared experts.
    dims = _gqa(config, base)
    return {
        **dims,
        "num_experts": _pos_int(config, "num_local_experts"),
        "moe_intermediate": base["intermediate"],
        "moe_layers": frozenset(range(base["num_layers"])),
    }


def _gpt_oss(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    # GQA whose attention_bias adds q/k/v *and* o_proj biases, per-head sinks; every layer MoE
    # with a biased router and biased, fused experts (intermediate_size is the per-expert size).
    dims = _gqa({**config, "attention_bias": False}, base)
    bias = bool(config.get("attention_bias"))
    return {
        **dims,
        "qkv_bias": bias,
        "o_bias": bias,
        "attn_sinks": True,
        "fused_experts": True,
        "num_experts": _pos_int(config, "num_local_experts"),
        "moe_intermediate": base["intermediate"],
        "moe_layers": frozenset(range(base["num_layers"])),
    }


def _glm4_moe(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    # GQA attention whose attention_bias means q/k/v biases only (o_proj has none), optional
    # qk norm; DeepSeek-style MoE (shared experts, router bias always present) after
    # first_k_dense_replace dense layers. Partial rotary changes no weight.
    dims = _gqa({**config, "attention_bias": False}, base)
    moe_inter = _pos_int(config, "moe_intermediate_size")
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return {
        **dims,
        "qkv_bias": bool(config.get("attention_bias")),
        "qk_norm": bool(config.get("use_qk_norm")),
        "num_experts": _pos_int(config, "n_routed_experts"),
        "moe_intermediate": moe_inter,
        "shared_intermediate": moe_inter * int(config.get("n_shared_experts") or 0),
        "moe_layers": frozenset(range(first_dense, base["num_layers"])),
        "expert_bias": True,
    }


def _deepseek_v3(config: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    q_lora = config.get("q_lora_rank")
    nope, rope = _pos_int(config, "qk_nope_head_dim"), _pos_int(config, "qk_rope_head_dim")
    experts = _pos_int(config, "n_routed_experts")
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    moe_inter = _pos_int(config, "moe_intermediate_size")
    moe = frozenset(i for i in range(base["num_layers"]) if i >= first_dense and i % freq == 0)
    return {
        **base,
        "num_kv_heads": base["num_heads"],
        "head_dim": nope + rope,
        "num_experts": experts,
        "moe_intermediate": moe_inter,
        "shared_intermediate": moe_inter * int(config.get("n_shared_experts") or 0),
        "moe_layers": moe,
        "expert_bias": config.get("topk_method") == "noaux_tc",
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": _pos_int(config, "kv_lora_rank"),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": _pos_int(config, "v_head_dim"),
    }


def refuse_quantized(config: dict[str, Any]) -> None:
    """A quantized checkpoint (FP8 DeepSeek-V3, Qwen3-FP8, MXFP4 gpt-oss) holds scale tensors and
    other dtypes than the manifest models: refuse it by name rather than plan it as bf16."""
    quant = config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    detail = ""
    if isinstance(quant, dict):
        extra = {k: quant[k] for k in ("fmt", "weight_block_size", "bits") if k in quant}
        detail = f" ({', '.join(f'{k}={v}' for k, v in extra.items())})" if extra else ""
    raise ModelConfigError(
        f"{config.get('model_type')}: quantization_config quant_method={method!r}{detail}: quantized "
        "checkpoints are not supported; plan the unquantized config (without quantization_config)"
    )


def config_dtype(config: dict[str, Any], known: tuple[str, ...]) -> str:
    """The checkpoint's dtype: `dtype` (transformers 5) or `torch_dtype`, bfloat16 when neither."""
    value = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if value not in known:
        raise ModelConfigError(
            f"{config.get('model_type')}: dtype {value!r} is not supported (known: {', '.join(known)})"
        )
    return str(value)


MTP_FAMILIES: frozenset[str] = frozenset({"deepseek_v3"})
"""Families whose MTP layers the manifest holds as its `mtp` part (DeepSeek-V3's checkpoint form:
`model.layers.{L}.{embed_tokens,enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}` plus
a decoder layer). Other families' MTP layers (GLM-4.5's) stay out, named by `not_synced`."""


def mtp_layer_count(config: dict[str, Any]) -> int:
    """n = num_nextn_predict_layers (0 when absent or not a positive int)."""
    n = config.get("num_nextn_predict_layers") or 0
    return n if isinstance(n, int) and n > 0 else 0


def mtp_span(config: dict[str, Any]) -> str:
    """The MTP layers' checkpoint names, e.g. `model.layers.61.*` or `model.layers.61..62.*`."""
    first, n = int(config.get("num_hidden_layers") or 0), mtp_layer_count(config)
    return f"model.layers.{first}{'' if n == 1 else f'..{first + n - 1}'}.*"


def mtp_layers(config: dict[str, Any]) -> list[tuple[int, bool]]:
    """(index, MoE?) of each MTP layer of an MTP_FAMILIES config: L..L+n-1, MoE by DeepSeek's rule
    for any layer (index >= first_k_dense_replace and index % moe_layer_freq == 0)."""
    if model_family(config) not in MTP_FAMILIES:
        return []
    first = int(config["num_hidden_layers"])
    dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    indices = range(first, first + mtp_layer_count(config))
    return [(i, i >= dense and i % freq == 0) for i in indices]


def not_synced(config: dict[str, Any]) -> list[str]:
    """What of the checkpoint the manifest leaves out, one line each (printed by plan and the
    report): MTP layers of a family outside MTP_FAMILIES (those of MTP_FAMILIES are its `mtp` part)."""
    n = mtp_layer_count(config)
    if n == 0 or model_family(config) in MTP_FAMILIES:
        return []
    return [f"{n} MTP layer(s) (num_nextn_predict_layers={n}, {mtp_span(config)}): not synced"]


def model_dims(config: dict[str, Any]) -> ModelDims:
    """Typed dimensions of a supported config; ModelConfigError for unknown families or missing fields."""
    refuse_quantized(config)
    family = model_family(config)
    base = _common(config, family)
    if family in ("llama", "gemma3_text"):
        fields = _gqa(config, base)
    elif family == "qwen3_moe":
        fields = _qwen3_moe(config, base)
    elif family == "mixtral":
        fields = _mixtral(config, base)
    elif family == "glm4_moe":
        fields = _glm4_moe(config, base)
    elif family == "gpt_oss":
        fields = _gpt_oss(config, base)
    else:
        fields = _deepseek_v3(config, base)
    dims = ModelDims(**fields)
    if not dims.mla and dims.num_heads % dims.num_kv_heads != 0:
        raise ModelConfigError(
            f"{dims.model_type}: num_attention_heads={dims.num_heads} is not a multiple of "
            f"num_key_value_heads={dims.num_kv_heads}"
        )
    return dims
