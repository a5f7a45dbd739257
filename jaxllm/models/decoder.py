"""The one decoder every supported family runs on (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM2,
Gemma 2/3, Mixtral, Qwen3-MoE, and the hybrids Qwen3-Next and Qwen3.5, whose linear layers
are `linear_attention.GatedDeltaNet`): a module whose `ModelConfig` switches cover the
differences (GQA ratio, qkv bias, QK-norm, sandwich norms, Gemma's (1 + w) norms and scaled
embeddings, GELU, tied head, RoPE scaling and per-layer RoPE bases, partial RoPE, per-layer
sliding windows, soft-capping, an attention output gate, mixture-of-experts MLPs).

The forward pass takes the flattened tokens of every scheduled request and the paged KV cache,
writes the new keys and values into the cache, and returns the final hidden states plus the
updated cache. Logits are computed separately, only for the rows the sampler needs.

The decoder layers are L separate modules, unrolled in Python: every layer's weights are
arrays of their own. Stacking them on a leading L axis under `lax.scan` compiles faster, but
XLA on CPU then copies each layer's weights out of the stack (`dynamic-slice`) before using
them: a decode step moved the weights three times instead of once (measured on the demo
model: 165 ms per step vs the ~25 ms its matmuls need). Unrolled, a layer's attention window
and RoPE are static values of that layer (the kernels also take the window as data, for a
scan).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import REFERENCE_KERNELS, CompilationConfig, ModelConfig, using_kernels
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
from jaxllm.models.linear_attention import GatedDeltaNet
from jaxllm.models.moe import MoE
from jaxllm.models.state import ModelCache, StepExtras
from jaxllm.quantization import QArray, qmatmul, take_rows
from pallas_kernels import as_kv_cache


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        *,
        dtype,
        mesh,
        rngs: nnx.Rngs | None,
    ):
        def norm():
            return RMSNorm(
                config.hidden_size,
                config.rms_norm_eps,
                offset=config.norm_offset,
                float_scale=config.norm_float_scale,
                dtype=dtype,
            )

        self.input_layernorm = norm()
        # The token mixer: attention over the paged KV cache, or (a hybrid's linear layers)
        # a Gated DeltaNet over its recurrent state.
        if config.layer_is_linear(layer):
            ordinal = config.linear_layers.index(layer)
            self.linear_attn = GatedDeltaNet(config, ordinal, dtype=dtype, mesh=mesh, rngs=rngs)
            self.self_attn = None
        else:
            self.self_attn = Attention(config, layer, dtype=dtype, mesh=mesh, rngs=rngs)
            self.linear_attn = None
        # Llama: post_attention_layernorm is the norm before the MLP. Sandwich (Gemma): it
        # normalises the attention output, and two more norms wrap the MLP.
        self.post_attention_layernorm = norm()
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        if config.layer_is_moe(layer):
            self.mlp = MoE(config, dtype=dtype, mesh=mesh, rngs=rngs)
        else:
            self.mlp = MLP(config, dtype=dtype, rngs=rngs)
        self.local_rope = config.layer_uses_local_rope(layer)

    def __call__(
        self,
        x,
        ropes: tuple[Rope, Rope],
        cache: ModelCache,
        layer: int,
        meta,
        lora,
        slots,
        q_scale=None,
    ) -> tuple[jax.Array, ModelCache]:
        """`slots`: each request's state slots (`StateSlots`, for a linear layer); `q_scale`
        f32[T] the queries' temperature (Llama 4's layers without RoPE), or None."""
        rope = ropes[1] if self.local_rope else ropes[0]
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            attn_out, linear = self.linear_attn(h, cache.linear, meta, slots)
            cache = dataclasses.replace(cache, linear=linear)
        else:
            attn_out, kv = self.self_attn(h, rope, cache.kv, layer, meta, lora, q_scale)
            cache = dataclasses.replace(cache, kv=kv)
        # Adapters of a mixture of experts' MLPs are not served (`jaxllm.lora`).
        dense = lora is not None and not isinstance(self.mlp, MoE)
        mlp = functools.partial(self.mlp, lora=lora) if dense else self.mlp
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn_out)
            mlp_out = mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(mlp_out), cache
        x = x + attn_out
        return x + mlp(self.post_attention_layernorm(x)), cache


class DecoderForCausalLM(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype=jnp.float32,
        compilation: CompilationConfig = REFERENCE_KERNELS,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs | None,
    ):
        """`compilation`: the engine's kernel choices, resolved (`attention_backend` one of
        the kernels, not "auto"); the forward pass and head are traced under them
        (`config.using_kernels`). `mesh`: tensor parallelism over its "model" axis
        (attention runs per device on its own heads); None for one device."""
        self.config = config
        self.compilation = compilation
        self.embed_tokens = param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), dtype
        )
        self.embed_scale = config.hidden_size**0.5 if config.scale_embeddings else None
        self.layers = nnx.List(
            DecoderLayer(config, i, dtype=dtype, mesh=mesh, rngs=rngs)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size,
            config.rms_norm_eps,
            offset=config.norm_offset,
            float_scale=config.norm_float_scale,
            dtype=dtype,
        )
        # Static (part of the graph definition, not parameters): tuples, not arrays.
        h = config.rotary_dim
        global_freq = rope_inv_freq(
            h, config.rope_theta, config.rope_scaling, config.rope_freq_factors
        )
        local_freq = (
            global_freq
            if config.rope_local_theta is None
            else rope_inv_freq(h, config.rope_local_theta)
        )
        self.inv_freq = (tuple(global_freq.tolist()), tuple(local_freq.tolist()))
        # YaRN's scale of cos and sin (the global RoPE's; the local one is never scaled).
        scaling = config.rope_scaling
        self.rope_scale = 1.0 if scaling is None else scaling.attention_factor
        self.mrope_section = config.mrope_section
        self.final_logit_softcapping = config.final_logit_softcapping
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(
                rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dtype
            )

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]; with M-RoPE i32[3, T]
        cache: ModelCache,
        meta: AttentionMetadata,
        extras: StepExtras | None = None,
    ) -> tuple[jax.Array, ModelCache]:  # [T, D], the updated cache
        """The hidden states of a step's tokens and the cache with their keys and values
        written. `extras`: the served features' inputs (adapters, image embeddings)."""
        extras = extras or StepExtras()
        with using_kernels(self.compilation):
            cache = dataclasses.replace(cache, kv=as_kv_cache(cache.kv))
            return self._forward(input_ids, positions, cache, meta, extras)

    def _forward(self, input_ids, positions, cache: ModelCache, meta, extras: StepExtras):
        table = self.embed_tokens.get_value()
        x = take_rows(table, input_ids) if isinstance(table, QArray) else table[input_ids]
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, x.dtype)  # rounded to the dtype, as HF does
        # An image-text model's image embeddings taken instead of their placeholders'
        # embeddings (after the scaling: HF merges them into the scaled embeddings).
        if (mm_embeds := extras.image_embeds()) is not None:
            rows, index = mm_embeds
            image = rows[jnp.maximum(index, 0)].astype(x.dtype)
            x = jnp.where((index >= 0)[:, None], image, x)
        global_rope = Rope.at(positions, self.inv_freq[0], self.mrope_section, self.rope_scale)
        local_rope = (
            global_rope
            if self.inv_freq[1] == self.inv_freq[0] and self.rope_scale == 1.0
            else Rope.at(positions, self.inv_freq[1], self.mrope_section)
        )
        loras = extras.layer_loras() or [None] * len(self.layers)
        ropes = (global_rope, local_rope)
        q_scale = None
        if self.config.attn_temperature_tuning:  # Llama 4: log1p(floor((p + 1) / s)) * a + 1
            p = positions.astype(jnp.float32)
            c = self.config
            q_scale = jnp.log1p(jnp.floor((p + 1.0) / c.floor_scale)) * c.attn_scale + 1.0
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                x, cache = layer(x, ropes, cache, i, meta, loras[i], extras.state_slots, q_scale)
        return self.norm(x), cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        with using_kernels(self.compilation):
            return self._logits(hidden)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            table = self.embed_tokens.get_value()
            if isinstance(table, QArray):  # [V, D] is already the head's [O, I]
                logits = qmatmul(hidden, table)
            else:
                logits = matmul(hidden, table, w_transposed=True)
        else:
            logits = linear(hidden, self.lm_head.get_value())
        logits = logits.astype(jnp.float32)
        cap = self.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
