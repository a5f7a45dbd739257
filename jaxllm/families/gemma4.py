"""Gemma 4 (text; the E2B/E4B, 26B-A4B and 31B checkpoints serve their text decoder): sliding
layers beside full-attention layers whose heads are wider (512 against 256) and fewer,
full-attention values equal to their keys before the key norm and RoPE (`attention_k_eq_v`),
proportional RoPE with a quarter of the frequencies turning on the full layers, RMSNorms
whose weight is the scale itself (not 1 + w as in Gemma 3) and a weightless norm on the
values, queries scaled by their norm alone (no 1 / sqrt(H)); in the small models, per-layer
inputs (a second embedding gated into every layer), the last layers sharing the KV of the
last earlier layer of their kind (`num_kv_shared_layers`) with MLPs twice as wide; in the
26B-A4B, a mixture of experts beside every dense MLP. Each layer's output is scaled by a
learned scalar. The vision and audio towers are not served."""

from __future__ import annotations

import re

from jaxllm.families.base import FULL_ATTENTION, Family, register

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
    return {
        "layer_types": tuple(types),
        "global_head_dim": dims.pop() if dims else None,
        "num_global_kv_heads": kvs.pop() if kvs else None,
        "attention_k_eq_v": bool(config.get("attention_k_eq_v", False)),
        "kv_shared_layers": int(config.get("num_kv_shared_layers") or 0),
        "double_wide_mlp": bool(config.get("use_double_wide_mlp", False)),
        "per_layer_input_size": int(config.get("hidden_size_per_layer_input") or 0),
        "per_layer_vocab_size": int(
            config.get("vocab_size_per_layer_input") or config["vocab_size"]
        ),
        # Proportional RoPE does its own partial rotation, over the whole head.
        "partial_rotary_factor": 1.0,
        "num_experts": experts if moe else 0,
        "num_experts_per_tok": int(config.get("top_k_experts") or 0) if moe else 0,
        "moe_intermediate_size": int(config.get("moe_intermediate_size") or 0) if moe else 0,
        "dense_layers": (),
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
    ),
    Family("Gemma4ForConditionalGeneration", text_of="Gemma4ForCausalLM"),
)
