"""gpt-oss (OpenAI's open-weight models, 20B and 120B): a mixture of experts on every layer,
layers alternating a 128-token sliding window with full attention, attention sinks (a learned
logit per head in each softmax's denominator), biases on q, k, v and o, YaRN RoPE, a router
with a bias, and experts with biases and a clamped SwiGLU. The experts come stacked in one
tensor per projection, gate and up interleaved (`loaders.weights`)."""

from __future__ import annotations

from jaxllm.families.base import Family, register


def _even_layers_slide(config: dict, num_layers: int) -> list[bool]:
    """transformers' default `layer_types`: layers 0, 2, 4, ... slide."""
    return [i % 2 == 0 for i in range(num_layers)]


def _read(config: dict) -> dict:
    return {
        "swiglu_limit": float(config.get("swiglu_limit") or 7.0),
        "swiglu_alpha": float(config.get("swiglu_alpha") or 1.702),
    }


register(
    Family(
        "GptOssForCausalLM",
        {
            "attention_sinks": True,
            "attention_bias": True,
            "attention_out_bias": True,
            "router_bias": True,
            "expert_bias": True,
            "rope_theta": 150000.0,
        },
        sliding_layers=_even_layers_slide,
        read_config=_read,
    )
)
