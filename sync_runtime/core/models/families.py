"""Which family's layout rules a config follows (design §3): by its causal-LM class, else by its
`model_type`; one line naming what was found for a config no family covers."""

from __future__ import annotations

from typing import Any

from sync_runtime.errors import ModelConfigError

# architectures[0] wins over model_type: Kimi-K2 reports model_type "kimi_k2" but is a
# DeepseekV3ForCausalLM, and fine-tunes often keep the architecture but rename the type.
_ARCH_FAMILY: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
}
LLAMA_LAYOUT: dict[str, str] = {
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "granite": "GraniteForCausalLM",
}
"""model_type -> causal-LM class of the families whose tensors are Llama's, name for name and
shape for shape (transformers' own models: tests/test_families.py checks each against Llama's on
the meta device). They plan, and sync, as the `llama` family; what differs (Mistral's sliding
window, Granite's multipliers) is in the forward pass, not in the weights."""
_ARCH_FAMILY |= {arch: "llama" for arch in LLAMA_LAYOUT.values()}
_TYPE_FAMILY: dict[str, str] = {
    **dict.fromkeys(LLAMA_LAYOUT, "llama"),
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "mixtral": "mixtral",
    "glm4_moe": "glm4_moe",
    "gemma3_text": "gemma3_text",
    "gpt_oss": "gpt_oss",
}
FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen3_moe",
    "deepseek_v3",
    "mixtral",
    "glm4_moe",
    "gemma3_text",
    "gpt_oss",
)


def model_family(config: dict[str, Any]) -> str:
    """The family of `config` (one of FAMILIES); ModelConfigError naming what was found otherwise."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in _ARCH_FAMILY:
            return _ARCH_FAMILY[arch]
    model_type = config.get("model_type")
    if model_type in _TYPE_FAMILY:
        return _TYPE_FAMILY[model_type]
    raise ModelConfigError(
        f"model_type={model_type!r}, architectures={archs!r}: unknown model family "
        f"(supported model_type: {', '.join(sorted(_TYPE_FAMILY))})"
    )
