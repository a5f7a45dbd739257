"""Qwen2/2.5, Qwen3 and Qwen3-MoE, Qwen2-VL and Qwen2.5-VL (a Qwen2 decoder with M-RoPE
positions after its vision tower, `jaxllm.models.qwen_vision`), and the hybrids Qwen3-Next and
Qwen3.5 (dense and MoE): Gated DeltaNet layers (`jaxllm.models.linear_attention`) between
gated full-attention layers, (1 + w) norms, partial RoPE, a shared expert beside the routed
ones."""

from __future__ import annotations

from jaxllm.families.base import (
    GGUF_EXPERT_NAMES,
    GGUF_LAYER_NAMES,
    GGUF_QK_NORM_NAMES,
    Family,
    GGUFFormat,
    register,
)


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


def _qwen3_moe_gguf_config(reader, config: dict) -> dict:
    """llama.cpp renormalizes Qwen3-MoE's chosen experts' weights unless the file says not."""
    return {"norm_topk_prob": bool(reader.field("qwen3moe.expert_weights_norm", True))}


def _hybrid(fused: bool, *, renormalize: bool | None = None):
    """The hybrids' own keys: the linear layers' shape, the shared expert, the routing."""

    def read(config: dict) -> dict:
        linear = dict(  # `hf_config.LinearAttention`'s fields
            num_key_heads=config["linear_num_key_heads"],
            num_value_heads=config["linear_num_value_heads"],
            key_head_dim=config["linear_key_head_dim"],
            value_head_dim=config["linear_value_head_dim"],
            conv_kernel=config["linear_conv_kernel_dim"],
            fused_projections=fused,
        )
        shared = config.get("shared_expert_intermediate_size") if config.get("num_experts") else 0
        out = {
            "linear_attention": linear,
            "attention_output_gate": bool(config.get("attn_output_gate", True)),
            "shared_expert_intermediate_size": shared or 0,
            # Served as text: M-RoPE's three position components are equal for text tokens,
            # which makes its interleaved sections plain RoPE.
            "mrope_section": None,
        }
        if renormalize is not None:
            out["moe_renormalize"] = renormalize
        elif "norm_topk_prob" in config:
            out["moe_renormalize"] = bool(config["norm_topk_prob"])
        return out

    return read


# (1 + w) norms stored as w, QK-norm (the output gate is read with the rest, `_hybrid`).
_HYBRID = {"qk_norm": True, "norm_offset": 1.0}


def _without_mtp(name: str) -> str | None:
    """The checkpoints' multi-token-prediction layers (`mtp.*`, a speculative head) are not
    served yet: skipped."""
    return None if name.startswith("mtp.") else name


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
    Family("Qwen3NextForCausalLM", _HYBRID, read_config=_hybrid(True), tensor_name=_without_mtp),
    Family("Qwen3_5ForCausalLM", _HYBRID, read_config=_hybrid(False), tensor_name=_without_mtp),
    Family(
        "Qwen3_5MoeForCausalLM",
        _HYBRID,
        read_config=_hybrid(False, renormalize=True),
        tensor_name=_without_mtp,
    ),
    Family("Qwen3_5ForConditionalGeneration", text_of="Qwen3_5ForCausalLM"),
    Family("Qwen3_5MoeForConditionalGeneration", text_of="Qwen3_5MoeForCausalLM"),
    Family(
        "Qwen3MoeForCausalLM",
        {"qk_norm": True, "moe_renormalize": False},
        read_config=_qwen3_moe_routing,
        gguf=GGUFFormat(
            "qwen3moe",
            "qwen3_moe",
            GGUF_QK_NORM_NAMES | GGUF_EXPERT_NAMES,
            read_config=_qwen3_moe_gguf_config,
        ),
    ),
)
