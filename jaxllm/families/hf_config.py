"""A Hugging Face `config.json` read into `ModelConfig`'s fields by the records of this
package: the architecture picks the family, whose `features` are defaults that the config's
own keys override; its `sliding_layers` and `read_config` read what the family says its own
way, and an image-text architecture is read as its text decoder (`text_of`). GGUF metadata
arrives here too, written as the same keys (`jaxllm.loaders.gguf`).

`ModelConfig.from_hf_config` builds the config from these fields. `RopeScaling`, HF's
`rope_scaling` record, `LinearAttention` (a hybrid's linear layers) and `LatentAttention`
(DeepSeek's multi-head latent attention), whose fields a family reads, are read here with
them; like the records, this module imports nothing of the library beyond this package.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxllm.families import (
    FAMILIES,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    text_family_of,
)


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers' shape (Qwen3-Next, Qwen3.5: the layers `layer_types` marks
    "linear_attention"): a causal depthwise convolution over the concatenated q, k and v,
    then the gated delta rule with one [value heads, key dim, value dim] state per request."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused_projections: bool = False
    """Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, interleaved per key head; Qwen3.5 has
    `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`."""

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q and k (key heads x key dim) and v."""
        return 2 * self.num_key_heads * self.key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one
    `kv_lora_rank`-wide latent per token, which with a `qk_rope_head_dim`-wide RoPE key
    (`ModelConfig.head_dim`, shared by every head) is all the cache keeps
    (`jaxllm.models.mla`)."""

    kv_lora_rank: int
    """L: the latent's width."""
    qk_nope_head_dim: int
    """P: the part of each query and key head without RoPE."""
    v_head_dim: int
    """V: each head's value width."""
    q_lora_rank: int | None
    """The query's own low-rank bottleneck (q_a_proj, its norm, q_b_proj); None: a plain
    q_proj (DeepSeek-V2-Lite)."""
    softmax_scale: float
    """Scores are scaled by this: (P + R) ** -0.5, times YaRN's mscale(factor,
    mscale_all_dim) squared where the config scales RoPE so."""

    def row_width(self, rope_dim: int) -> int:
        """The cache's row per token: the latent and the RoPE key, [c_kv | k_pe]."""
        return self.kv_lora_rank + rope_dim


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "llama3" (Llama 3.1's smooth low-frequency scaling), "linear"
    (every frequency divided by `factor`, as Gemma 3's global layers) or "yarn" (gpt-oss,
    DeepSeek-V3: frequencies blended between interpolated and extrapolated along a ramp
    between `beta_fast` and `beta_slow` rotations, and cos/sin scaled by `attention_factor`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    """YaRN: the ramp's ends rounded to whole dimensions (transformers' default)."""
    attention_factor: float = 1.0
    """cos and sin are multiplied by this (YaRN's mscale); 1 for the other types."""
    partial_rotary_factor: float = 1.0
    """"proportional" (Gemma 4's full-attention layers): only the first factor x H / 2
    frequencies turn, with exponents over the whole head; the others are zero."""

    @classmethod
    def from_hf(
        cls, params: dict[str, Any] | None, max_position_embeddings: int | None = None
    ) -> RopeScaling | None:
        """From a Hugging Face `rope_scaling` / `rope_parameters` dict; None for plain RoPE.
        `max_position_embeddings`: the config's, YaRN's default original context."""
        if not isinstance(params, dict):
            return None
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in ("default", "mrope"):  # M-RoPE's sections: `ModelConfig.mrope_section`
            return None
        if kind == "linear":
            return cls("linear", float(params["factor"]))
        if kind == "llama3":
            return cls(
                "llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        if kind == "yarn":
            return cls._yarn(params, max_position_embeddings)
        if kind == "proportional":
            return cls(
                "proportional",
                factor=float(params.get("factor", 1.0)),
                partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
            )
        raise ValueError(
            f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, yarn, "
            "proportional)"
        )

    @classmethod
    def _yarn(cls, params: dict[str, Any], max_position_embeddings: int | None) -> RopeScaling:
        """YaRN's parameters as transformers reads them (`_compute_yarn_parameters`)."""
        original = params.get("original_max_position_embeddings") or max_position_embeddings
        if not original:
            raise ValueError("rope_scaling yarn needs original_max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = (max_position_embeddings or original) / original

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            if params.get("mscale") and params.get("mscale_all_dim"):
                attention_factor = mscale(factor, params["mscale"]) / mscale(
                    factor, params["mscale_all_dim"]
                )
            else:
                attention_factor = mscale(factor)
        return cls(
            "yarn",
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
        )


def model_config_fields(config: dict[str, Any] | Any) -> dict[str, Any]:
    """`ModelConfig`'s keyword arguments from a Hugging Face `config.json` (a dict or a
    PretrainedConfig), or GGUF metadata in its keys (plus `rope_freq_factors`)."""
    if not isinstance(config, dict):
        config = config.to_dict()
    archs = config.get("architectures") or []
    headless = [a for a in archs if a.endswith(("ForSequenceClassification", "Model"))]
    if headless:
        # A decoder without its LM head: a classifier or reranker (its `score` head is
        # `jaxllm.classifier`'s) or a base model (Qwen3Model, MistralModel: embedders).
        # The embedding stands in for the LM head, which the engine never uses for them:
        # they serve pooling only.
        base = headless[0].removesuffix("ForSequenceClassification").removesuffix("Model")
        base += "ForCausalLM"
        if base in FAMILIES:
            config = {**config, "architectures": [base], "tie_word_embeddings": True}
            archs = [base]
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None:
        raise ValueError(
            f"unsupported architecture {archs or config.get('model_type')!r}; "
            f"supported: {', '.join(FAMILIES)}"
        )
    if family.text_of is not None:  # an image-text model: its text decoder
        family = text_family_of(family, config)
        config = {**config, **config.get("text_config", {})}
    arch = family.architecture
    features = dict(family.features)
    num_heads = config["num_attention_heads"]
    num_layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads

    # RoPE: transformers 5 writes `rope_parameters` (per layer type for Gemma 3), older
    # configs `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
    rope = config.get("rope_parameters") or {}
    local_rope = rope.get(SLIDING_ATTENTION) if isinstance(rope, dict) else None
    if isinstance(rope, dict) and FULL_ATTENTION in rope:
        rope = rope[FULL_ATTENTION]
    default_theta = features.pop("rope_theta", 10000.0)
    default_local_theta = features.pop("rope_local_theta", None)
    rope_theta = config.get("rope_theta") or rope.get("rope_theta") or default_theta
    rope_scaling = RopeScaling.from_hf(
        config.get("rope_scaling") or rope, config.get("max_position_embeddings")
    )
    rope_local_theta = config.get("rope_local_base_freq") or default_local_theta
    if local_rope is not None:
        if RopeScaling.from_hf(local_rope) is not None:
            raise ValueError("model config: scaled RoPE on sliding layers is not supported")
        rope_local_theta = local_rope.get("rope_theta", rope_local_theta)

    sliding_window = config.get("sliding_window")
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        sliding_window = None  # Qwen2/3 carry a window they do not use
    layer_types = tuple(config.get("layer_types") or ())
    if not layer_types and sliding_window is not None:
        # Older configs name no layer types: derive them as transformers does.
        slides = family.sliding_layers(config, num_layers)
        layer_types = tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in slides)

    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    dense_layers: tuple[int, ...] = ()
    if num_experts:
        step = config.get("decoder_sparse_step") or 1
        only = set(config.get("mlp_only_layers") or ())
        dense_layers = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    # HF's `attention_bias` puts biases on q, k, v and o.
    if config.get("attention_bias") is not None:
        features["attention_bias"] = features["attention_out_bias"] = bool(config["attention_bias"])
    activation = config.get("hidden_activation") or config.get("hidden_act")
    if activation:
        features["hidden_act"] = activation
    if family.read_config is not None:  # what the family reads its own way
        features.update(family.read_config(config))
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    factors = config.get("rope_freq_factors")
    if isinstance(features.get("linear_attention"), dict):
        features["linear_attention"] = LinearAttention(**features["linear_attention"])
    if isinstance(features.get("latent_attention"), dict):
        features["latent_attention"] = LatentAttention(**features["latent_attention"])
    partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    features.setdefault("partial_rotary_factor", float(partial))
    rotary_dim = int(head_dim * features["partial_rotary_factor"])
    mrope = (config.get("rope_scaling") or rope or {}).get("mrope_section")
    if "mrope_section" in features:  # the family's word (a text decoder served without it)
        mrope = features.pop("mrope_section")
    if mrope is not None and 2 * sum(mrope) != rotary_dim:
        raise ValueError(
            f"mrope_section {mrope} must sum to the rotary dim / 2 ({rotary_dim // 2})"
        )
    read = dict(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rope_freq_factors=tuple(float(f) for f in factors) if factors else None,
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", features.pop("tie_word_embeddings", False))
        ),
        sliding_window=sliding_window,
        layer_types=layer_types,
        rope_local_theta=None if rope_local_theta is None else float(rope_local_theta),
        mrope_section=None if mrope is None else tuple(int(n) for n in mrope),
        query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        num_experts=num_experts,
        num_experts_per_tok=(config.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=(
            (config.get("moe_intermediate_size") or config["intermediate_size"])
            if num_experts
            else 0
        ),
        dense_layers=dense_layers,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    # The family's fields (its defaults, and what it reads its own way) win over the common
    # reading: Llama 4's MLP widths, say.
    return {**read, **features}
