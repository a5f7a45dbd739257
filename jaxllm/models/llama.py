"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2): one module whose
config switches cover the differences (GQA ratio, qkv bias, tied head, rope scaling,
sliding window).

The forward pass takes the flattened tokens of every scheduled request and one paged KV cache
per layer, writes the new keys and values into the cache, and returns the final hidden states
plus the updated caches. Logits are computed separately, only for the rows the sampler needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.models.layers import MLP, Attention, AttentionMetadata, RMSNorm, param


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(
            config, dtype=dtype, attention_backend=attention_backend, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, meta: AttentionMetadata):
        attn_out, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
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
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.embed_tokens = param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), dtype
        )
        self.layers = nnx.List(
            [
                DecoderLayer(config, dtype=dtype, attention_backend=attention_backend, rngs=rngs)
                for _ in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
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
        kv_caches: list[jax.Array],  # per layer [num_pages, page_size, 2K, H]
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[jax.Array]]:  # [T, D], updated caches
        x = self.embed_tokens[...][input_ids]
        new_caches = []
        # Layers are unrolled (not scanned) so that each layer's cache stays its own donated
        # buffer, updated in place, and each attention call sees exactly one layer's cache.
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x, cache = layer(x, positions, kv_caches[i], meta)
            new_caches.append(cache)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        if self.lm_head is None:
            logits = jnp.einsum("RD,VD->RV", hidden, self.embed_tokens[...])
        else:
            logits = jnp.einsum("RD,DV->RV", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)
