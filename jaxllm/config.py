"""Configuration: one small frozen dataclass per concern, validated on construction.

`ModelConfig` describes the network (built from a Hugging Face `config.json` or from GGUF
metadata); `CacheConfig`, `SchedulerConfig` and `EngineConfig` describe how it is served.
CLI flags and `LLM(...)` keyword arguments map one-to-one onto these fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Hugging Face `architectures` entries we can run; the model registry maps them to classes.
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
}


def resolve_dtype(dtype: Any) -> jnp.dtype:
    """Maps "auto", a name such as "bfloat16", or a dtype to a jnp dtype.

    "auto" is float32 on CPU (exact parity with references) and bfloat16 on accelerators.
    """
    if dtype is None or dtype == "auto":
        import jax

        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    architecture: str
    """The Hugging Face architecture name, e.g. "LlamaForCausalLM"."""
    vocab_size: int
    hidden_size: int
    """D: the width of the residual stream."""
    intermediate_size: int
    """F: the width of the gated MLP."""
    num_layers: int
    num_heads: int
    """N: query heads."""
    num_kv_heads: int
    """K: key/value heads (GQA when K < N)."""
    head_dim: int
    """H: the width of one head."""
    max_position_embeddings: int
    """The context the model was trained for; `max_model_len` defaults to it."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    tie_word_embeddings: bool = False
    """The output head reuses the token embedding (no `lm_head.weight`)."""
    sliding_window: int | None = None
    """Attention looks back at most this many tokens (Mistral); None for full attention."""
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

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | Any) -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` (a dict or a PretrainedConfig)."""
        if not isinstance(config, dict):
            config = config.to_dict()
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in LLAMA_FAMILY), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"supported: {', '.join(LLAMA_FAMILY)}"
            )
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        scaling = config.get("rope_scaling") or config.get("rope_parameters")
        rope_theta = config.get("rope_theta")
        if isinstance(scaling, dict) and rope_theta is None:
            rope_theta = scaling.get("rope_theta")
        rope_scaling = None
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        scaling["original_max_position_embeddings"]
                    ),
                )
            elif kind != "default":
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding_window = config.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    page_size: int = 16
    """Tokens per page (block)."""
    num_pages: int | None = None
    """Pages in the pool; None derives it from `memory_utilization`."""
    memory_utilization: float = 0.9
    """Share of device memory the weights and KV cache may use (vLLM's
    `gpu_memory_utilization`). On CPU, where JAX reports no memory limit, the KV cache gets
    `cpu_kv_cache_gib` instead."""
    cpu_kv_cache_gib: float = 1.0

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 512
    """Most tokens (prefill chunks + decodes) in one step."""
    policy: str = "fcfs"
    """"fcfs": waiting requests in arrival order, the newest running one is preempted first.
    "priority": by (priority, arrival), lower values first; the lowest-priority, newest
    running request is preempted first."""

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running request needs a token"
            )
