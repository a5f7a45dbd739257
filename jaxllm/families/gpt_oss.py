"""gpt-oss (OpenAI's open-weight models, 20B and 120B): a mixture of experts on every layer,
layers alternating a 128-token sliding window with full attention, attention sinks (a learned
logit per head in each softmax's denominator), biases on q, k, v and o, YaRN RoPE, a router
with a bias, and experts with biases and a clamped SwiGLU. The experts come stacked in one
tensor per projection, gate and up interleaved (`loaders.weights`). llama.cpp's GGUF files
(architecture "gpt-oss") split gate and up, and keep the experts in MXFP4 (`loaders.gguf`)."""

from __future__ import annotations

import re

from jaxllm.families.base import GGUF_EXPERT_NAMES, GGUF_LAYER_NAMES, Family, GGUFFormat, register

# The experts' stacked gate_up tensors (and biases) interleave gate and up column by column:
# named for the layout the loader splits (`loaders.weights`).
_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.gate_up_proj)(_bias)?$")


def _tensor_name(name: str) -> str:
    m = _GATE_UP.match(name)
    return name if m is None else f"{m.group(1)}_interleaved{m.group(2) or ''}"


def _even_layers_slide(config: dict, num_layers: int) -> list[bool]:
    """transformers' default `layer_types`: layers 0, 2, 4, ... slide."""
    return [i % 2 == 0 for i in range(num_layers)]


def _read(config: dict) -> dict:
    return {
        "swiglu_limit": float(config.get("swiglu_limit") or 7.0),
        "swiglu_alpha": float(config.get("swiglu_alpha") or 1.702),
    }


def _gguf_config(reader, config: dict) -> dict:
    """gpt-oss's YaRN does not round its correction range to whole dimensions (its config's
    `truncate: false`), which llama.cpp's metadata does not say."""
    scaling = config.get("rope_scaling")
    return {"rope_scaling": {**scaling, "truncate": False}} if scaling else {}


_GGUF_NAMES = {
    **{k: v for k, v in GGUF_LAYER_NAMES.items() if k != "ffn_norm.weight"},
    **GGUF_EXPERT_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
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
            "norm_float_scale": True,
        },
        sliding_layers=_even_layers_slide,
        read_config=_read,
        tensor_name=_tensor_name,
        gguf=GGUFFormat(
            "gpt-oss",
            "gpt_oss",
            _GGUF_NAMES,
            end_of_turn=("<|return|>", "<|call|>"),  # harmony's ends of an answer or a call
            read_config=_gguf_config,
        ),
    )
)
