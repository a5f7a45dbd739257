"""Configuration: one small frozen dataclass per concern, validated on construction.

`ModelConfig` describes the network (built from a Hugging Face `config.json` or from GGUF
metadata). `EngineConfig` describes how it is served, one section per concern: `LoadConfig`
(the model source and overrides), `CacheConfig`, `SchedulerConfig`, `ParallelConfig`,
`CompilationConfig` and `SpeculativeConfig`. Each of their fields is declared once, with its default and a docstring;
the `LLM(...)` keyword arguments, the command line's flags (`add_cli_args`, vLLM's names as
aliases where vLLM has the concept) and their `--help` all come from those declarations.

This module imports no JAX, so `jaxllm --help` starts fast.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from typing import Any

from jaxllm.families import (
    FAMILIES,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    text_family_of,
)

_DTYPES = {
    "float32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
}


def resolve_dtype(dtype: Any, platform: str | None = None):
    """Maps "auto", a name such as "bfloat16", or a dtype to a jnp dtype.

    "auto" is float32 on CPU (exact parity with references) and bfloat16 on accelerators;
    `platform` (default: JAX's default backend) is the one the engine runs on.
    """
    import jax
    import jax.numpy as jnp

    if dtype is None or dtype == "auto":
        cpu = (platform or jax.default_backend()) == "cpu"
        return jnp.dtype(jnp.float32 if cpu else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "llama3" (Llama 3.1's smooth low-frequency scaling) or "linear"
    (every frequency divided by `factor`, as Gemma 3's global layers)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeScaling | None:
        """From a Hugging Face `rope_scaling` / `rope_parameters` dict; None for plain RoPE."""
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
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer: the Llama layout plus the switches other
    families need (each family's module in `jaxllm.families` says which it turns on)."""

    architecture: str
    """The Hugging Face architecture name, e.g. "LlamaForCausalLM"."""
    vocab_size: int
    hidden_size: int
    """D: the width of the residual stream."""
    intermediate_size: int
    """F: the width of the gated MLP (of the dense layers, in a mixture of experts)."""
    num_layers: int
    num_heads: int
    """N: query heads."""
    num_kv_heads: int
    """K: key/value heads (GQA when K < N)."""
    head_dim: int
    """H: the width of one head (not always hidden / heads: Gemma, Qwen3)."""
    max_position_embeddings: int
    """The context the model was trained for; `max_model_len` defaults to it."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    """llama.cpp's `rope_freqs` (Llama 3.1 GGUF files): the inverse frequencies are divided
    by these instead of applying `rope_scaling`."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2; others where their config says so)."""
    attention_out_bias: bool = False
    """Bias on the output projection (HF's `attention_bias` outside Qwen2)."""
    tie_word_embeddings: bool = False
    """The output head reuses the token embedding (no `lm_head.weight`)."""
    sliding_window: int | None = None
    """How far the sliding-window layers look back (Mistral: all layers; Gemma: the layers
    `layer_types` marks "sliding_attention"); None for full attention everywhere."""
    layer_types: tuple[str, ...] = ()
    """Per layer, "full_attention" or "sliding_attention"; empty: every layer slides when
    `sliding_window` is set."""
    rope_local_theta: float | None = None
    """The RoPE base of the sliding-window layers, without scaling (Gemma 3: 10,000 while
    the global layers use 1,000,000); None: the same RoPE as every other layer."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2.5-VL): positions are (time, row, column) triples, and RoPE's frequencies
    fall in these sections, each rotated by one component (they sum to head_dim / 2)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Gemma 3, Qwen3)."""
    sandwich_norms: bool = False
    """Norms before and after both attention and MLP (Gemma 2/3) instead of before only."""
    norm_offset: float = 0.0
    """RMSNorm scales by (offset + weight): 1 for Gemma, whose weights are stored as w - 1."""
    scale_embeddings: bool = False
    """Token embeddings are multiplied by sqrt(hidden_size) (Gemma)."""
    hidden_act: str = "silu"
    """The gate's activation: "silu" or "gelu_pytorch_tanh" (Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this ** -0.5 instead of head_dim ** -0.5 (Gemma)."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(score / cap) (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Output logits become cap * tanh(logit / cap) (Gemma 2)."""
    num_experts: int = 0
    """E: experts of each mixture-of-experts layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """How many experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """The MLP width of one expert."""
    moe_renormalize: bool = True
    """Routing weights of the chosen experts are renormalised to sum to 1 (Mixtral; Qwen3-MoE
    per its `norm_topk_prob`)."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a mixture-of-experts model that keep a dense MLP (Qwen3-MoE's
    `mlp_only_layers` and `decoder_sparse_step`)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    kv_head_replicas: int = 1
    """Each checkpoint kv head is repeated this many times (tensor parallelism over more
    devices than kv heads, see `sharding.shard_config`); num_kv_heads counts the copies."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"model config: sliding_window must be >= 1, got {self.sliding_window}"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"model config: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )
        bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if bad:
            raise ValueError(f"model config: unsupported layer_types {sorted(bad)}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"model config: hidden_act must be silu or gelu_pytorch_tanh, got "
                f"{self.hidden_act!r}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model config: num_experts_per_tok must be in [1, {self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError("model config: moe_intermediate_size must be >= 1")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer`; None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def layer_uses_local_rope(self, layer: int) -> bool:
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    def layer_is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | Any) -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` (a dict or a PretrainedConfig).
        GGUF metadata arrives here too, as the same keys (plus `rope_freq_factors`)."""
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
        rope_scaling = RopeScaling.from_hf(config.get("rope_scaling") or rope)
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
            features["attention_bias"] = features["attention_out_bias"] = bool(
                config["attention_bias"]
            )
        activation = config.get("hidden_activation") or config.get("hidden_act")
        if activation:
            features["hidden_act"] = activation
        if family.read_config is not None:  # what the family reads its own way
            features.update(family.read_config(config))
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        factors = config.get("rope_freq_factors")
        mrope = (config.get("rope_scaling") or rope or {}).get("mrope_section")
        if mrope is not None and 2 * sum(mrope) != head_dim:
            raise ValueError(f"mrope_section {mrope} must sum to head_dim / 2 ({head_dim // 2})")
        return cls(
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
            **features,
        )


# ---- how the model is served ------------------------------------------------------------
#
# Every field below is an `LLM(...)` keyword argument and a flag of `jaxllm generate` and
# `jaxllm serve` (its name with dashes); its docstring is the flag's help. `option` adds what a
# flag needs beyond that: vLLM's spelling as an alias, and the choices.


def option(default: Any, *aliases: str, choices: tuple[str, ...] | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"aliases": aliases, "choices": choices})


# pallas_kernels.ATTENTION_BACKENDS, spelled out here so the command line need not import JAX
# (tests/test_cli_and_cache.py checks that they agree). `jaxllm.quantization` takes its names
# from here (see its docstring).
QUANTIZATIONS = ("int8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors", "float")
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu")
QUANT_MATMUL_BACKENDS = ("auto", "xla", "pallas")
# The KV cache's formats: the float dtypes, and pallas_kernels.QUANTIZED_KV_DTYPES (plus vLLM's
# alias fp8_e4m3), checked against it by the same test.
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", *_DTYPES, *QUANTIZED_KV_CACHE_DTYPES, "fp8_e4m3")


def _parse_json_field(config: Any, name: str) -> None:
    """A dict field given as JSON text (as its flag takes it), parsed in place."""
    value = getattr(config, name)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
        object.__setattr__(config, name, parsed)


def _check_types(config: Any) -> None:
    """A clear error naming the parameter for a value of the wrong type (a string where a
    number belongs, a bool for an int, ...), before any comparison trips over it, or outside
    the field's `choices`."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        ok = any(
            (value is None and t is type(None))
            or (t is bool and isinstance(value, bool))
            or (t is int and isinstance(value, int) and not isinstance(value, bool))
            or (t is float and isinstance(value, int | float) and not isinstance(value, bool))
            or (t is str and isinstance(value, str))
            or (t is dict and isinstance(value, dict))
            or (
                typing.get_origin(t) is tuple
                and isinstance(value, tuple)
                and all(isinstance(v, typing.get_args(t)[0]) for v in value)
            )
            for t in allowed
        )
        if not ok:
            want = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {want}, got {value!r}")
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            want = " or ".join(choices) if len(choices) == 2 else f"one of {', '.join(choices)}"
            raise ValueError(f"{f.name} must be {want}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """Where the model comes from, and how its weights are loaded."""

    model: str
    """HF checkpoint directory, .gguf file, orbax checkpoint (`jaxllm convert`), or a demo
    model's name (smollm2-135m)."""
    dtype: str = option("auto", choices=("auto", *_DTYPES))
    """The weights' dtype: auto is float32 on CPU (exact parity with references), bfloat16
    on accelerators."""
    seed: int = 0
    """Seeds the seeds of requests that give none, so a run repeats."""
    quantization: str | None = option(None, "-q", choices=QUANTIZATIONS)
    """Weight quantization: int8 (per channel), int4 (groups of 32, with offsets) or fp8
    (e4m3, per channel) quantize the linear layers and embedding at load; gguf keeps a GGUF
    file's quantized tensors as they are (none: on accelerators, and on CPUs with 8-bit dot
    products; on other CPUs none dequantizes them), as gptq, awq and compressed-tensors (or none) do a checkpoint's of that method;
    float dequantizes them at load (see jaxllm/quantization.py)."""
    load_format: str = option("auto", choices=("auto", "dummy"))
    """auto reads the weights from the model; dummy makes random ones in its shapes (a
    directory with config.json alone will do), to measure speed and memory without a
    checkpoint: the tokens mean nothing."""
    runner: str = option("auto", choices=("auto", "generate", "pooling"))
    """What the model serves (vLLM's --runner): generate (completions) or pooling (its pooled
    hidden states: embeddings, scores). auto: pooling for an encoder (BERT), and for a
    decoder whose sentence-transformers files pool it (Qwen3-Embedding); generate otherwise."""
    pooler_config: str | None = None
    """JSON over the checkpoint's pooling, vLLM's keys: {"pooling_type": "MEAN", "CLS" or
    "LAST", "normalize": true or false} (a decoder served with --runner pooling and no
    sentence-transformers files pools its last token, normalized)."""

    def __post_init__(self) -> None:
        if hasattr(self.model, "__fspath__"):  # a Path is welcome
            object.__setattr__(self, "model", str(self.model))
        _check_types(self)
        if not str(self.model):
            raise ValueError("model must not be empty")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    page_size: int = option(16, "--block-size")
    """Tokens per KV page (vLLM's block size); a power of two."""
    num_pages: int | None = option(None, "--num-gpu-blocks-override")
    """Pages in the KV pool; default: as many as `memory_utilization` leaves room for."""
    memory_utilization: float = option(0.9, "--gpu-memory-utilization")
    """Share of device memory the engine may use (weights, KV cache, temporaries). On a GPU
    it is vLLM's gpu_memory_utilization: a share of the whole device, to which JAX's memory
    pool is set (`jaxllm.kv_sizing`). On CPU, where JAX reports no memory limit, the KV cache
    gets `cpu_kv_cache_gib` instead."""
    cpu_kv_cache_gib: float = 1.0
    """The KV cache's size on CPU, in GiB."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes."""
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES)
    """The KV cache's format: auto is the model's dtype (float32 on CPU); int8 and fp8 (e4m3,
    alias fp8_e4m3) store 8 bits per value with a float32 scale per token and head, for
    about 2x the pages of bfloat16 (4x float32) in the same memory."""
    kv_offloading_size: float = 0.0
    """GiB of host memory for a second tier of the prefix cache (vLLM's flag): full blocks
    evicted from the device pool are copied there and copied back when a prompt's prefix
    hits them, instead of being recomputed; 0: off. Needs prefix caching."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every token of every layer, sliding-window layers included (vLLM's flag). By
    default a model that mixes sliding-window and full-attention layers (Gemma 2/3) keeps
    only the window's blocks in its sliding layers, for more sequences in the same memory
    (see `jaxllm.kv_groups`)."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be >= 0, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching (enable_prefix_caching)")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching."""

    max_model_len: int | None = None
    """Longest sequence (prompt + output) a request may reach; default: the model's context,
    clipped to what the KV cache holds. The engine fills it in when it starts."""
    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 512
    """Most tokens (prefill chunks + decodes) in one step."""
    scheduling_policy: str = option("fcfs", choices=("fcfs", "priority"))
    """fcfs: waiting requests in arrival order, the newest running one is preempted first.
    priority: by (priority, arrival), lower values first; the lowest-priority, newest running
    request is preempted first, and a waiting request may preempt lower-priority ones."""
    async_scheduling: bool = True
    """Schedule each step while the previous one runs on the device."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running request needs a token"
            )


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices, and hosts (see `jaxllm.engine.multihost`)."""

    tensor_parallel_size: int | None = None
    """Split the model and its KV cache over this many devices; default: 1 on one host,
    every device of every host in a multi-host run."""
    distributed: bool = False
    """Join a multi-host run (`jax.distributed`): host 0 schedules (and serves HTTP), the
    others execute its steps. Implied by `coordinator_address`; on Cloud TPU VMs JAX
    discovers the coordinator, the process count and this host's id."""
    coordinator_address: str | None = None
    """host:port of process 0's coordinator (env JAXLLM_COORDINATOR_ADDRESS)."""
    num_processes: int | None = None
    """Processes (hosts) in the run (env JAXLLM_NUM_PROCESSES)."""
    process_id: int | None = None
    """This process's index, 0 on the host that schedules (env JAXLLM_PROCESS_ID)."""
    lockstep_address: str | None = None
    """tcp://HOST0:PORT of the channel host 0 sends its steps on (env
    JAXLLM_LOCKSTEP_ADDRESS); default: the coordinator's host, one port above it."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"process_id must be >= 0, got {self.process_id}")

    @property
    def multihost(self) -> bool:
        """Whether this process is asked to join a multi-host run."""
        return self.distributed or any(
            v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)
        )


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """The runner's programs."""

    attention_backend: str = option("auto", choices=ATTENTION_BACKENDS)
    """auto: the platform's kernel (on CPU the native `cpu` kernel, or `xla` where no C++
    compiler builds it); pallas: the platform's Pallas kernel (interpreted on CPU, for
    checking); or a backend by name."""
    quant_matmul_backend: str = option("auto", choices=QUANT_MATMUL_BACKENDS)
    """The matmul of quantized weights: auto is the native kernel on CPU and XLA's
    dequantization fused into the dot on TPU and GPU; xla those XLA ops everywhere; pallas the
    Pallas (Triton) kernel for NVIDIA GPUs, not yet measured on one (interpreted elsewhere,
    for checking)."""
    skip_warmup: bool = False
    """Do not compile every bucket at startup (programs then compile on first use)."""
    compilation_cache_dir: str | None = "default"
    """JAX's persistent compilation cache: default is `xla` under $JAXLLM_CACHE_DIR or
    ~/.cache/jaxllm; none leaves JAX's own setting alone."""

    def __post_init__(self) -> None:
        if self.compilation_cache_dir is not None and hasattr(
            self.compilation_cache_dir, "__fspath__"
        ):  # a Path is welcome
            object.__setattr__(self, "compilation_cache_dir", str(self.compilation_cache_dir))
        _check_types(self)


@dataclasses.dataclass(frozen=True)
class SpecMethod:
    """A validated speculative decoding setup (`SpeculativeConfig.method`)."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: the most draft tokens verified per request and step
    prompt_lookup_min: int = 0  # ngram: the shortest and longest suffix n-gram looked up
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model: its checkpoint (any `model` this engine loads)


MAX_SPECULATIVE_TOKENS = 16
_SPEC_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding."""

    speculative_config: dict | None = None
    """vLLM's JSON: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    "prompt_lookup_min": m} proposes the k tokens that followed the latest earlier occurrence
    of the sequence's last n..m tokens; {"model": PATH, "num_speculative_tokens": k} runs a
    draft model with the target's vocabulary. The target verifies the drafts in its next step:
    the output is the one without speculation (each step runs synchronously)."""

    def __post_init__(self) -> None:
        _parse_json_field(self, "speculative_config")
        _check_types(self)
        _ = self.method  # validates the setup now, naming what is wrong

    @functools.cached_property
    def method(self) -> SpecMethod | None:
        """The setup, validated; None when speculative decoding is off."""
        c = self.speculative_config
        if c is None:
            return None
        unknown = sorted(set(c) - _SPEC_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                f"{', '.join(sorted(_SPEC_KEYS))})"
            )

        def integer(key: str, default: int | None, low: int, high: int) -> int:
            value = c.get(key, default)
            if value is None:
                raise ValueError(f"speculative_config: {key} is required")
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(
                    f"speculative_config: {key} must be an integer in [{low}, {high}], got "
                    f"{value!r}"
                )
            return value

        k = integer("num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        model = c.get("model")
        method = c.get("method", "draft_model" if model is not None else None)
        if method == "ngram":
            if model is not None:
                raise ValueError("speculative_config: method ngram takes no model")
            # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
            lo, hi = c.get("prompt_lookup_min"), c.get("prompt_lookup_max")
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            lo = integer("prompt_lookup_min", lo, 1, 1024)
            hi = integer("prompt_lookup_max", hi, 1, 1024)
            if lo > hi:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                    f"prompt_lookup_max ({hi})"
                )
            return SpecMethod("ngram", k, lo, hi)
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: a draft model needs model (its path)")
            extra = {"prompt_lookup_min", "prompt_lookup_max"} & set(c)
            if extra:
                raise ValueError(f"speculative_config: {', '.join(sorted(extra))} is for ngram")
            return SpecMethod("draft_model", k, model=model)
        raise ValueError(
            f"speculative_config: method must be ngram or draft_model (or give a model), got "
            f"{method!r}"
        )


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's flags): many PEFT adapters over the one base model, each request
    naming its own (or none), served in the same batch."""

    enable_lora: bool = False
    """Serve LoRA adapters (`LoRARequest` offline; the server's --lora-modules and `model`)."""
    max_loras: int = 1
    """Adapters on the device at once: the most distinct ones in a step (others wait)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have (every slot is padded to it)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (least recently used dropped); default max_loras."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """Image inputs of an image-text model (vLLM's flags)."""

    limit_mm_per_prompt: dict | None = None
    """The most items of each modality one prompt may carry, as vLLM's JSON: {"image": 4};
    default 16 images."""
    allowed_local_media_path: str | None = None
    """A directory whose files (and only those) requests may name as `file://` image URLs;
    default: none may."""
    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts whose http(s) image URLs requests may name (a host, or its subdomains), fetched
    without redirects within 5 s and 20 MB; default: no URL is fetched."""
    max_num_encoder_input_tokens: int | None = None
    """The most image tokens the vision encoder computes in one step; default
    max_num_batched_tokens (at least one image)."""
    encoder_cache_size: int | None = None
    """Image tokens the encoder cache holds on the device (encoded images, kept while their
    requests need them and reused by image content); default max_num_encoder_input_tokens."""
    enable_mm_embeds: bool = False
    """Prompts may carry image embeddings instead of images (offline, vLLM's
    `{"image": {"image_embeds": ...}}`), written to the encoder cache as they are."""
    mm_processor_kwargs: dict | None = None
    """Settings of the model's HF image processor over its preprocessor_config.json, as
    vLLM's JSON: Qwen2.5-VL's {"max_pixels": 1003520} bounds an image's tokens (here 1280),
    and so the encoder's largest program and the encoder cache."""

    def __post_init__(self) -> None:
        _parse_json_field(self, "limit_mm_per_prompt")
        _parse_json_field(self, "mm_processor_kwargs")
        if isinstance(self.allowed_media_domains, list | str):
            domains = self.allowed_media_domains
            domains = tuple(domains.split(",") if isinstance(domains, str) else domains)
            object.__setattr__(self, "allowed_media_domains", domains)
        _check_types(self)
        limits = self.limit_mm_per_prompt or {}
        for modality, n in limits.items():
            if modality != "image":
                raise ValueError(
                    f"limit_mm_per_prompt: modality {modality!r} is not supported (only image)"
                )
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"limit_mm_per_prompt: image must be an integer >= 0, got {n!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def image_limit(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", 16)

    def encoder_plan(
        self, max_item_tokens: int, block_tokens: int, max_num_batched_tokens: int
    ) -> tuple[int, int]:
        """(the encoder cache's blocks of `block_tokens` rows, the image tokens a step
        encodes): each holds at least the largest image, `max_item_tokens`."""
        budget = max(self.max_num_encoder_input_tokens or max_num_batched_tokens, max_item_tokens)
        size = max(self.encoder_cache_size or budget, max_item_tokens)
        return -(-size // block_tokens), budget


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how an engine is built, one section per concern.

    `EngineConfig.create(model, max_num_seqs=8, ...)` takes the sections' fields flat, by
    name (the `LLM(...)` keyword arguments); `add_cli_args` and `from_cli` do the same for a
    command line."""

    load: LoadConfig
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compilation: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)

    @staticmethod
    def fields() -> dict[str, tuple[str, dataclasses.Field]]:
        """Every flat field name -> (its section, its field)."""
        return _flat_fields()

    @classmethod
    def create(cls, model: Any, **kwargs: Any) -> EngineConfig:
        """Builds the sections from flat keyword arguments; a name that is no field raises."""
        fields = _flat_fields()
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        sections: dict[str, dict[str, Any]] = {s.name: {} for s in dataclasses.fields(cls)}
        kwargs["model"] = model
        for name, value in kwargs.items():
            sections[fields[name][0]][name] = value
        return cls(**{s: _hints(cls)[s](**values) for s, values in sections.items()})

    def flat(self) -> dict[str, Any]:
        """The inverse of `create`: every field by name."""
        return {
            name: getattr(getattr(self, section), name)
            for name, (section, _) in _flat_fields().items()
        }

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of a command line parsed by a parser `add_cli_args` filled in."""
        values = {name: getattr(args, name) for name in _flat_fields()}
        return cls.create(values.pop("model"), **values)

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with some flat fields changed."""
        return EngineConfig.create(**{**self.flat(), **kwargs})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A class's annotations, resolved (this module postpones them), once per class."""
    return typing.get_type_hints(cls)


@functools.cache
def _flat_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    hints = _hints(EngineConfig)
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(hints[section.name]):
            assert f.name not in out, f"engine field {f.name!r} is declared twice"
            out[f.name] = (section.name, f)
    return out


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under a dataclass's fields (a string literal right after the field),
    read from its source as Sphinx reads them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs = {}
    for a, b in itertools.pairwise(tree.body[0].body):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = " ".join(inspect.cleandoc(b.value.value).split())
    return docs


def _cli_value(hint: Any):
    """argparse's `type` for a field: its type, with "none" for None where None is allowed."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    base = next(t for t in allowed if t is not type(None))
    if typing.get_origin(base) is tuple:  # one or more values (`nargs="+"`)
        base = typing.get_args(base)[0]
    if base is dict:  # JSON text, parsed by the section
        base = str
    if type(None) not in allowed:
        return base

    def parse(text: str):
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its errors
    return parse


def add_cli_args(parser: argparse.ArgumentParser, *, model_flag: bool = False) -> None:
    """Adds a flag per engine field (see `add_dataclass_args`) and the model positional (a
    required `--model` with `model_flag`, as `vllm bench` spells it)."""
    for section in dataclasses.fields(EngineConfig):
        cls = _hints(EngineConfig)[section.name]
        if cls is LoadConfig:
            doc = field_docs(cls)["model"]
            if model_flag:
                parser.add_argument("--model", required=True, help=doc)
            else:
                parser.add_argument("model", help=doc)
        add_dataclass_args(parser, cls, skip=("model",))


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()
) -> None:
    """Adds a flag per field of the dataclass `cls`: `--max-num-seqs` for `max_num_seqs`,
    bools as `--x/--no-x`, tuples as one or more values, `option`'s aliases (vLLM's names) and
    choices, the field's docstring as help. `from_cli_args` reads them back."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint, doc = _hints(cls)[f.name], field_docs(cls).get(f.name, "")
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = f.default
        if hint is bool:
            shown = "on" if default else "off"
            kind = {"action": argparse.BooleanOptionalAction}
        else:
            shown = default
            choices = f.metadata.get("choices")
            kind = {"dest": f.name, "type": _cli_value(hint), "choices": choices}
            allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            if any(typing.get_origin(t) is tuple for t in allowed):
                kind["nargs"] = "+"
        help_text = doc if default is None else f"{doc} (default: {shown})"
        parser.add_argument(*flags, default=default, help=help_text.replace("%", "%%"), **kind)


def from_cli_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The dataclass `cls` from a command line `add_dataclass_args` made the flags of (lists
    of values become tuples)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**{**values, **overrides})


# The kernel choices travel one way: the model is built with the engine's (resolved)
# `CompilationConfig` and puts it in this context around its forward pass and head, where the
# kernels' call sites read it while the step is traced (`kernel_choices()`). A new choice is
# one field of `CompilationConfig` and its use.
REFERENCE_KERNELS = CompilationConfig(attention_backend="reference")
"""The choices of a model built without an engine (tests, researchers): the reference
attention, the platform's quantized matmul."""
_KERNEL_CHOICES: contextvars.ContextVar[CompilationConfig] = contextvars.ContextVar(
    "jaxllm_kernel_choices", default=REFERENCE_KERNELS
)


@contextlib.contextmanager
def using_kernels(compilation: CompilationConfig):
    """Within it (while a function is traced), the kernels follow `compilation`."""
    token = _KERNEL_CHOICES.set(compilation)
    try:
        yield
    finally:
        _KERNEL_CHOICES.reset(token)


def kernel_choices() -> CompilationConfig:
    """The `CompilationConfig` the function being traced was built with."""
    return _KERNEL_CHOICES.get()
