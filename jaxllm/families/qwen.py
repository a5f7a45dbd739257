"""Qwen2/2.5, Qwen3 and Qwen3-MoE, and Qwen2-VL and Qwen2.5-VL (a Qwen2 decoder with M-RoPE
positions after its vision tower, `jaxllm.models.qwen_vision`)."""

from __future__ import annotations

from jaxllm.families.base import GGUF_LAYER_NAMES, GGUF_QK_NORM_NAMES, Family, GGUFFormat, register


def _from_max_window_layers(config: dict, num_layers: int) -> list[bool]:
    """Layers from `max_window_layers` on slide (when `use_sliding_window` is on)."""
    first = config.get("max_window_layers") or 0
    return [i >= first for i in range(num_layers)]


def _qwen2_bias(config: dict) -> dict:
    # Biases on q, k and v, none on o, whatever `attention_bias` says (transformers ignores
    # the key for Qwen2).
    return {"attention_bias": True, "attention_out_bias": False}


def _qwen3_moe_routing(config: dict) -> dict:
    # Its `norm_topk_prob` says whether the chosen experts' weights are renormalized.
    if "norm_topk_prob" in config:
        return {"moe_renormalize": bool(config["norm_topk_prob"])}
    return {}


register(
    Family(
        "Qwen2ForCausalLM",
        sliding_layers=_from_max_window_layers,
        read_config=_qwen2_bias,
        gguf=GGUFFormat("qwen2", "qwen2", GGUF_LAYER_NAMES),
    ),
    Family(
        "Qwen3ForCausalLM",
        {"qk_norm": True},
        sliding_layers=_from_max_window_layers,
        gguf=GGUFFormat("qwen3", "qwen3", GGUF_QK_NORM_NAMES),
    ),
    Family("Qwen2VLForConditionalGeneration", text_of="Qwen2ForCausalLM"),
    Family("Qwen2_5_VLForConditionalGeneration", text_of="Qwen2ForCausalLM"),
    Family(
        "Qwen3MoeForCausalLM",
        {"qk_norm": True, "moe_renormalize": False},
        read_config=_qwen3_moe_routing,
    ),
)
