"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2): one module whose
config switches cover the differences (GQA ratio, qkv bias, tied head, rope scaling,
sliding window).

The forward pass takes the flattened tokens of every scheduled request and the paged KV cache,
writes the new keys and values into the cache, and returns the final hidden states plus the
updated cache. Logits are computed separately, only for the rows the sampler needs.

The decoder layers are one stacked module (every parameter has a leading L axis, created with
`nnx.vmap`) run under `lax.scan`: each step program traces and compiles one layer instead of
L copies, which is what keeps startup (every bucket is compiled) short. The KV cache rides in
the scan's carry and each layer writes and reads `cache[layer]` in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig
from jaxllm.models.layers import MLP, Attention, AttentionMetadata, RMSNorm, param


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, attention_backend: str, mesh, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(
            config, dtype=dtype, attention_backend=attention_backend, mesh=mesh, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, layer, meta: AttentionMetadata):
        attn_out, kv_cache = self.self_attn(
            self.input_layernorm(x), positions, kv_cache, layer, meta
        )
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
        rngs: nnx.Rngs,
    ):
        """`mesh`: tensor parallelism over its "model" axis (attention runs per device on its
        own heads); None for one device."""
        self.config = config
        self.embed_tokens = param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), dtype
        )

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(
                config, dtype=dtype, attention_backend=attention_backend, mesh=mesh, rngs=rngs
            )

        self.layers = make_layers(rngs)  # one module, parameters stacked on a leading L axis
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
        kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:  # [T, D], updated cache
        x = self.embed_tokens[...][input_ids]
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, layer_state):
            x, kv_cache, i = carry
            layer = nnx.merge(graphdef, layer_state)
            x, kv_cache = layer(x, positions, kv_cache, i, meta)
            return (x, kv_cache, i + 1), None

        with jax.named_scope("layers"):
            (x, kv_cache, _), _ = jax.lax.scan(body, (x, kv_cache, jnp.int32(0)), stacked)
        return self.norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        if self.lm_head is None:
            logits = jnp.einsum("RD,VD->RV", hidden, self.embed_tokens[...])
        else:
            logits = jnp.einsum("RD,DV->RV", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)
