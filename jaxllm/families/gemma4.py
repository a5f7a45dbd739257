"""Gemma 4 (text; the E2B/E4B, 26B-A4B and 31B checkpoints serve their text decoder): sliding
layers beside full-attention layers whose heads are wider (512 against 256) and fewer,
full-attention values equal to their keys before the key norm and RoPE (`attention_k_eq_v`),
proportional RoPE with a quarter of the frequencies turning on the full layers, RMSNorms
whose weight is the scale itself (not 1 + w as in Gemma 3) and a weightless norm on the
values, queries scaled by their norm alone (no 1 / sqrt(H)); in the small models, per-layer
inputs (a second embedding gated into every layer), the last layers sharing the KV of the
last earlier layer of their kind (`num_kv_shared_layers`) with MLPs twice as wide; in the
26B-A4B, a mixture of experts beside every dense MLP. Each layer's output is scaled by a
learned scalar. The vision and audio towers are not served. GGUF files (architecture
"gemma4") state most of this per layer (`_gguf_config`)."""

from __future__ import annotations

import re

from jaxllm.families.base import (
    FULL_ATTENTION,
    GGUF_QK_NORM_NAMES,
    SLIDING_ATTENTION,
    Family,
    GGUFFormat,
    register,
)

_EXPERTS = re.compile(r"^(model\.layers\.\d+\.)(router|experts)\.(.+)$")


def _tensor_name(name: str) -> str | None:
    m = _EXPERTS.match(name)
    if m is None:
        return name
    layer, kind, rest = m.groups()
    # The MoE block is `moe` beside `mlp`; its experts are output-major ([E, 2F, D], [E, D, F]).
    if kind == "router":
        rest = {"proj.weight": "router.weight"}.get(rest, f"router_{rest}")
    elif rest in ("gate_up_proj", "down_proj"):
        rest = f"experts.{rest}_output_major"
    return f"{layer}moe.{rest}"


def _read(config: dict) -> dict:
    num_layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        FULL_ATTENTION if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    full = [i for i, t in enumerate(types) if t == FULL_ATTENTION]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    # transformers 5 writes the full layers' head width and kv heads as `per_layer_config`
    # overrides; without it, it derives them from these keys as below.
    overrides = config.get("per_layer_config")
    if overrides is None:
        over = {"head_dim": config.get("global_head_dim") or 512}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
            over["num_key_value_heads"] = config["num_global_key_value_heads"]
        overrides = {i: over for i in full}
    overrides = {int(k): v or {} for k, v in overrides.items()}
    for layer, over in overrides.items():
        if layer not in full and over:
            raise ValueError(
                f"Gemma 4 config: per_layer_config overrides layer {layer}; only the "
                "full-attention layers' are supported"
            )
        unknown = set(over) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ValueError(f"Gemma 4 config: unsupported per_layer_config keys {sorted(unknown)}")
    dims = {overrides.get(i, {}).get("head_dim", head_dim) for i in full}
    kvs = {overrides.get(i, {}).get("num_key_value_heads", kv_heads) for i in full}
    if len(dims) > 1 or len(kvs) > 1:
        raise ValueError(
            "Gemma 4 config: per_layer_config gives full-attention layers different head_dim "
            "or num_key_value_heads; one value for all of them is supported"
        )
    experts = config.get("num_experts") or 0
    moe = bool(config.get("enable_moe_block")) and experts > 0
    per_layer = int(config.get("hidden_size_per_layer_input") or 0)
    return {
        "layer_types": tuple(types),
        "global_head_dim": dims.pop() if dims else None,
        "num_global_kv_heads": kvs.pop() if kvs else None,
        "attention_k_eq_v": bool(config.get("attention_k_eq_v", False)),
        "kv_shared_layers": int(config.get("num_kv_shared_layers") or 0),
        "double_wide_mlp": bool(config.get("use_double_wide_mlp", False)),
        "per_layer_input_size": per_layer,
        "per_layer_vocab_size": int(
            config.get("vocab_size_per_layer_input") or config["vocab_size"]
        )
        if per_layer
        else 0,  # (no per-layer inputs: the vocabulary size a config names is moot)
        # Proportional RoPE does its own partial rotation, over the whole head.
        "partial_rotary_factor": 1.0,
        "num_experts": experts if moe else 0,
        "num_experts_per_tok": int(config.get("top_k_experts") or 0) if moe else 0,
        "moe_intermediate_size": int(config.get("moe_intermediate_size") or 0) if moe else 0,
        "dense_layers": (),
    }


def _per_layer(reader, key: str, types: list[str], kind: str):
    """GGUF value `key`, given once or per layer (llama.cpp's arrays): the `kind` layers'."""
    value = reader.field(key)
    if not isinstance(value, list):
        return value
    if len(value) != len(types):
        raise ValueError(f"Gemma 4 GGUF: {key} has {len(value)} values for {len(types)} layers")
    values = {v for v, t in zip(value, types, strict=True) if t == kind}
    if len(values) > 1:
        raise ValueError(f"Gemma 4 GGUF: {key} differs between {kind} layers: {sorted(values)}")
    return values.pop() if values else None


def _gguf_config(reader, config: dict) -> dict:
    """Gemma 4's keys from what llama.cpp's converter (`Gemma4Model`) writes: the layer kinds
    as a per-layer sliding flag, the full layers' head width as `key_length` and the sliding
    ones' as `key_length_swa`, kv heads and MLP widths per layer (the shared-KV layers' MLPs
    twice as wide), the proportional RoPE of the full layers as a `rope_freqs` tensor of
    ones (the turning pairs) then 1e30 (the still ones), which only those layers read;
    full-attention layers without `attn_v` take their values from their keys."""
    import numpy as np

    num_layers = config["num_hidden_layers"]
    pattern = reader.field("gemma4.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(
            "Gemma 4 GGUF: gemma4.attention.sliding_window_pattern must flag every layer"
        )
    types = [SLIDING_ATTENTION if s else FULL_ATTENTION for s in pattern]
    full = [i for i, t in enumerate(types) if t == FULL_ATTENTION]
    head_dim = reader.field("gemma4.attention.key_length_swa")
    if head_dim is None:
        raise ValueError("Gemma 4 GGUF: gemma4.attention.key_length_swa is missing")
    global_head_dim = reader.field("gemma4.attention.key_length")
    kv = "gemma4.attention.head_count_kv"
    widths = reader.field("gemma4.feed_forward_length")
    shared = int(reader.field("gemma4.attention.shared_kv_layers", 0))
    width = widths[0] if isinstance(widths, list) else widths
    double_wide = isinstance(widths, list) and len(set(widths)) > 1
    if double_wide and widths != [width] * (num_layers - shared) + [2 * width] * shared:
        raise ValueError(
            f"Gemma 4 GGUF: gemma4.feed_forward_length {widths} is neither one width nor "
            f"twice it on the last {shared} (shared-KV) layers"
        )
    tensors = {t.name: t for t in reader.tensors}
    rotary_swa = reader.field("gemma4.rope.dimension_count_swa", head_dim)
    if rotary_swa != head_dim:
        raise ValueError(
            f"Gemma 4 GGUF: sliding layers turning {rotary_swa} of {head_dim} dimensions "
            "(partial RoPE there) are not supported"
        )
    rope_full: dict = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if "rope_freqs.weight" in tensors:
        turning = int(np.sum(np.asarray(config["rope_freq_factors"]) < 1e29))
        rope_full = {
            "rope_type": "proportional",
            "partial_rotary_factor": turning / (global_head_dim // 2),
            "rope_theta": config["rope_theta"],
        }
    experts = int(config.get("num_local_experts") or 0)
    per_layer = reader.field("gemma4.embedding_length_per_layer_input", 0)
    per_layer_embd = tensors.get("per_layer_token_embd.weight")
    return {
        "layer_types": types,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_key_value_heads": _per_layer(reader, kv, types, SLIDING_ATTENTION),
        "num_global_key_value_heads": _per_layer(reader, kv, types, FULL_ATTENTION),
        "attention_k_eq_v": any(
            f"blk.{i}.attn_k.weight" in tensors and f"blk.{i}.attn_v.weight" not in tensors
            for i in full
        ),
        "num_kv_shared_layers": shared,
        "intermediate_size": width,
        "use_double_wide_mlp": double_wide,
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": None if per_layer_embd is None else per_layer_embd.shape[0],
        "rope_parameters": {
            FULL_ATTENTION: rope_full,
            SLIDING_ATTENTION: {
                "rope_type": "default",
                # llama.cpp: the full layers' base where the file gives no other
                "rope_theta": reader.field("gemma4.rope.freq_base_swa", config["rope_theta"]),
            },
        },
        "rope_freq_factors": None,  # the full layers' proportional RoPE, above
        "enable_moe_block": experts > 0,
        "num_experts": experts or None,
        "top_k_experts": config.get("num_experts_per_tok"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


_GGUF_NAMES = {
    **GGUF_QK_NORM_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    # The MoE block, its experts output-major as in the checkpoints (`_tensor_name`).
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}

register(
    Family(
        "Gemma4ForCausalLM",
        {
            "tie_word_embeddings": True,
            "sandwich_norms": True,
            "scale_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh",
            "qk_norm": True,
            "v_norm": True,
            "norm_float_scale": True,
            "query_pre_attn_scalar": 1.0,
            "layer_scalar": True,
            "moe_beside_mlp": True,
            "rope_theta": 1_000_000.0,
            "rope_local_theta": 10_000.0,
        },
        read_config=_read,
        tensor_name=_tensor_name,
        gguf=GGUFFormat(
            "gemma4",
            "gemma4_text",
            _GGUF_NAMES,
            end_of_turn=("<turn|>",),
            read_config=_gguf_config,
        ),
    ),
    Family("Gemma4ForConditionalGeneration", text_of="Gemma4ForCausalLM"),
)
