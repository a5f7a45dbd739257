"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2): one module whose
config switches cover the differences (GQA ratio, qkv bias, tied head, rope scaling,
sliding window).

The forward pass takes the flattened tokens of every scheduled request and the paged KV cache,
writes the new keys and values into the cache, and returns the final hidden states plus the
updated cache. Logits are computed separately, only for the rows the sampler needs.

The decoder layers are L separate modules, unrolled in Python: every layer's weights are
arrays of their own. Stacking them on a leading L axis under `lax.scan` compiles faster, but
XLA on CPU then copies each layer's weights out of the stack (`dynamic-slice`) before using
them: a decode step moved the weights three times instead of once (measured on the demo
model: 165 ms per step vs the ~25 ms its matmuls need).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig
from jaxllm.models.layers import (
    MLP,
    Attention,
    AttentionMetadata,
    RMSNorm,
    Rope,
    linear,
    matmul,
    param,
    rope_inv_freq,
)


class DecoderLayer(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, dtype, attention_backend: str, mesh, rngs: nnx.Rngs | None
    ):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(
            config, dtype=dtype, attention_backend=attention_backend, mesh=mesh, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, rope: Rope, kv_cache, layer: int, meta: AttentionMetadata):
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), rope, kv_cache, layer, meta)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype=jnp.float32,
        attention_backend: str = "reference",
        mesh: Mesh | None = None,
        rngs: nnx.Rngs | None,
    ):
        """`mesh`: tensor parallelism over its "model" axis (attention runs per device on its
        own heads); None for one device."""
        self.config = config
        self.embed_tokens = param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), dtype
        )

        self.layers = nnx.List(
            DecoderLayer(
                config, dtype=dtype, attention_backend=attention_backend, mesh=mesh, rngs=rngs
            )
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        # Static (part of the graph definition, not a parameter): a tuple, not an array.
        self.inv_freq = tuple(
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).tolist()
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(
                rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dtype
            )

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:  # [T, D], updated cache
        x = self.embed_tokens.get_value()[input_ids]
        rope = Rope.at(positions, self.inv_freq)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                x, kv_cache = layer(x, rope, kv_cache, i, meta)
        return self.norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        if self.lm_head is None:
            logits = matmul(hidden, self.embed_tokens.get_value(), w_transposed=True)
        else:
            logits = linear(hidden, self.lm_head.get_value())
        return logits.astype(jnp.float32)
