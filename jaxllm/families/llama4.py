"""Llama 4 (Scout, Maverick), served as text: three of every four layers attend within chunks of
`attention_chunk_size` positions with RoPE turning adjacent channel pairs and L2-normalised
queries and keys, the fourth attends to everything without RoPE and scales its queries up at
long positions (temperature tuning); mixture-of-experts layers (every one, or interleaved with
dense ones) route each token to its top expert by a sigmoid score that scales the expert's
input, beside a shared expert. Image-text checkpoints (`Llama4ForConditionalGeneration`)
serve their text decoder; the vision tower is not served yet. GGUF files (architecture
"llama4") store none of the attention's settings: llama.cpp's are read (`_gguf_config`)."""

from __future__ import annotations

import re

from jaxllm.families.base import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    GGUF_EXPERT_NAMES,
    GGUF_LAYER_NAMES,
    Family,
    GGUFFormat,
    register,
)

# feed_forward.* -> mlp.*; the experts' stacked gate and up halves get the name of the layout
# the loader splits (`loaders.weights`).
_FEED_FORWARD = re.compile(r"^(model\.layers\.\d+\.)feed_forward\.(.+)$")


def _tensor_name(name: str) -> str:
    m = _FEED_FORWARD.match(name)
    if m is None:
        return name
    layer, rest = m.groups()
    if rest == "experts.gate_up_proj":
        rest = "experts.gate_up_proj_concatenated"
    return f"{layer}mlp.{rest}"


def _read(config: dict) -> dict:
    num_layers = config["num_hidden_layers"]
    interval = config.get("no_rope_layer_interval") or 4
    no_rope = config.get("no_rope_layers") or [
        int((i + 1) % interval != 0) for i in range(num_layers)
    ]  # 1: the layer uses RoPE
    chunk = config.get("attention_chunk_size")
    types = config.get("layer_types") or [
        CHUNKED_ATTENTION if rope and chunk is not None else FULL_ATTENTION for rope in no_rope
    ]
    step = config.get("interleave_moe_layer_step") or 1
    moe_layers = config.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, num_layers, step))
    experts = config.get("num_local_experts") or 0
    return {
        "layer_types": tuple(types),
        "attention_chunk_size": chunk,
        "nope_layers": tuple(i for i, rope in enumerate(no_rope) if not rope),
        "qk_l2_norm": bool(config.get("use_qk_norm", True)),
        "attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
        "attn_scale": float(config.get("attn_scale", 0.1)),
        "floor_scale": float(config.get("floor_scale", 8192)),
        # The dense layers' MLP is `intermediate_size_mlp` wide; an expert (and the shared
        # one) `intermediate_size`.
        "intermediate_size": config.get("intermediate_size_mlp") or config["intermediate_size"],
        "moe_intermediate_size": config["intermediate_size"] if experts else 0,
        "shared_expert_intermediate_size": config["intermediate_size"] if experts else 0,
        "dense_layers": tuple(i for i in range(num_layers) if i not in set(moe_layers)),
    }


def _gguf_config(reader, config: dict) -> dict:
    """What llama.cpp fixes for Llama 4 rather than reading (`llama_model::load_hparams` and
    its hparams' defaults): chunks of 8192 positions, every fourth layer without RoPE and with
    temperature tuning (scale 0.1 from 8192 positions), L2 q/k norms but in the 128-expert
    Maverick. A file whose sliding window is 0 (MobileLLM-R1) runs llama.cpp's plain Llama
    graph: no chunks, RoPE on every layer, no temperature tuning (the q/k norms stay). The
    dense layers' MLP width is the file's feed-forward length, an expert's its own."""
    num_layers = config["num_hidden_layers"]
    chunked = reader.field("llama4.attention.sliding_window") != 0
    # The common reading lists the layers without a router (all of them without experts).
    dense = set(config.get("mlp_only_layers", range(num_layers)))
    return {
        "intermediate_size_mlp": config["intermediate_size"],
        "intermediate_size": config.get("moe_intermediate_size") or config["intermediate_size"],
        "attention_chunk_size": 8192 if chunked else None,
        "no_rope_layers": [int(not chunked or (i + 1) % 4 != 0) for i in range(num_layers)],
        "attn_temperature_tuning": chunked,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "use_qk_norm": config.get("num_local_experts") != 128,
        "moe_layers": [i for i in range(num_layers) if i not in dense],
    }


_GGUF_NAMES = {
    **GGUF_LAYER_NAMES,
    **{k: v for k, v in GGUF_EXPERT_NAMES.items() if k.endswith(".weight")},
    "ffn_gate_inp.weight": "mlp.router.weight",
    **{
        f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight"
        for p in ("gate", "up", "down")
    },
}

register(
    Family(
        "Llama4ForCausalLM",
        {
            "rope_interleaved": True,
            "router_sigmoid": True,
            "moe_weight_inputs": True,
            "moe_renormalize": False,
            "shared_expert_gated": False,
            "rope_theta": 500000.0,
        },
        read_config=_read,
        tensor_name=_tensor_name,
        gguf=GGUFFormat(
            "llama4",
            "llama4_text",
            _GGUF_NAMES,
            end_of_turn=("<|eot|>", "<|eom|>"),
            read_config=_gguf_config,
        ),
    ),
    Family("Llama4ForConditionalGeneration", text_of="Llama4ForCausalLM"),
)
