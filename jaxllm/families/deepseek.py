"""DeepSeek-V2 and DeepSeek-V3 (and what ships as their architecture: Kimi K2, the V3.1 and R1
releases): multi-head latent attention (`jaxllm.models.mla`) in every layer, and a mixture of
experts after the first `first_k_dense_replace` dense layers, with a shared expert beside the
routed ones. V3 scores experts by sigmoid, chooses them with a correction bias within the best
groups (`n_group`, `topk_group`) and renormalises; V2 scores by softmax, chooses greedily or
within the groups whose best expert is best (`topk_method`). Both scale the routed weights
(`routed_scaling_factor`). The checkpoints' multi-token-prediction layers (V3's
`model.layers.{num_hidden_layers}.*`) are skipped here; `{"method": "mtp"}` reads the first
as a draft head (`jaxllm.loaders.mtp`)."""

from __future__ import annotations

import math
import re

from jaxllm.families.base import Family, register

_SHARED = re.compile(r"^(model\.layers\.\d+\.mlp\.)shared_experts\.(.+)$")


def _tensor_name(name: str) -> str:
    m = _SHARED.match(name)
    if m is not None:
        return f"{m.group(1)}shared_expert.{m.group(2)}"
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return name.removesuffix("gate.e_score_correction_bias") + "router_score_bias"
    return name


def _softmax_scale(config: dict, qk_head_dim: int) -> float:
    """(P + R) ** -0.5, times YaRN's mscale squared where RoPE is scaled and the config names
    `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def _reader(v3: bool):
    def read(config: dict) -> dict:
        if config.get("attention_bias"):
            raise ValueError(
                "DeepSeek config: attention_bias is not supported with latent attention"
            )
        nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        num_layers = config["num_hidden_layers"]
        experts = config.get("n_routed_experts") or 0
        first = config.get("first_k_dense_replace") or 0
        freq = config.get("moe_layer_freq") or 1
        out = {
            "head_dim": rope,  # RoPE's width; the cache's row is the latent's (LatentAttention)
            "num_kv_heads": 1,
            "latent_attention": dict(
                kv_lora_rank=config["kv_lora_rank"],
                qk_nope_head_dim=nope,
                v_head_dim=config["v_head_dim"],
                q_lora_rank=config.get("q_lora_rank"),
                softmax_scale=_softmax_scale(config, nope + rope),
            ),
            "attention_bias": False,
            "attention_out_bias": False,
            # V2 turns RoPE's adjacent pairs always (complex products), V3 as it says
            "rope_interleaved": bool(config.get("rope_interleave", True)) if v3 else True,
        }
        if not experts:
            return out
        method = config.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        grouped = method in ("noaux_tc", "group_limited_greedy")
        if method not in ("noaux_tc", "group_limited_greedy", "greedy"):
            raise ValueError(f"DeepSeek config: unsupported topk_method {method!r}")
        if (method == "noaux_tc") != v3:
            raise ValueError(
                f"DeepSeek config: topk_method {method!r} does not go with "
                f"{'DeepseekV3' if v3 else 'DeepseekV2'}ForCausalLM"
            )
        shared = config.get("n_shared_experts") or 0
        renormalize = bool(config.get("norm_topk_prob", v3))
        scaling = float(config.get("routed_scaling_factor") or 1.0)
        return out | {
            "num_experts": experts,
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "dense_layers": tuple(
                i for i in range(num_layers) if not (i >= first and i % freq == 0)
            ),
            "router_scoring": "sigmoid" if v3 else "softmax",
            "router_score_bias": v3,
            "router_float32": True,
            "expert_groups": (config.get("n_group") or 1) if grouped else 1,
            "expert_groups_kept": (config.get("topk_group") or 1) if grouped else 1,
            "moe_renormalize": renormalize,
            # V2's own code renormalises or scales, not both (V3 does both)
            "routed_scaling_factor": 1.0 if renormalize and not v3 else scaling,
            "shared_expert_intermediate_size": config["moe_intermediate_size"] * shared,
            "shared_expert_gated": False,
        }

    return read


register(
    Family(
        "DeepseekV2ForCausalLM",
        read_config=_reader(v3=False),
        tensor_name=_tensor_name,
        layers_past_the_last_skipped=True,
    ),
    Family(
        "DeepseekV3ForCausalLM",
        read_config=_reader(v3=True),
        tensor_name=_tensor_name,
        layers_past_the_last_skipped=True,
    ),
)
