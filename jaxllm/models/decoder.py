"""The one decoder every supported family runs on (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM2,
Gemma 2/3/4, Mixtral, Qwen3-MoE, gpt-oss, Llama 4, the hybrids Qwen3-Next and Qwen3.5, whose
linear layers are `linear_attention.GatedDeltaNet`, and DeepSeek-V2/V3, whose attention is
`mla.MLAttention`): a module whose `ModelConfig` switches cover the
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
    ACTIVATIONS,
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
from jaxllm.models.mla import MLAttention
from jaxllm.models.moe import MoE
from jaxllm.models.state import ModelCache, StepExtras
from jaxllm.quantization import QUANTIZED, qmatmul, take_rows
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
            kind = Attention if config.latent_attention is None else MLAttention
            self.self_attn = kind(config, layer, dtype=dtype, mesh=mesh, rngs=rngs)
            self.linear_attn = None
        # Llama: post_attention_layernorm is the norm before the MLP. Sandwich (Gemma): it
        # normalises the attention output, and two more norms wrap the MLP.
        self.post_attention_layernorm = norm()
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # Gemma 4's MoE block: experts beside the dense MLP, each with norms of its own.
        moe = config.layer_is_moe(layer)
        beside = moe and config.moe_beside_mlp
        if moe and not beside:
            self.mlp = MoE(config, dtype=dtype, mesh=mesh, rngs=rngs)
        else:
            self.mlp = MLP(
                config, dtype=dtype, rngs=rngs, width=config.layer_intermediate_size(layer)
            )
        self.moe = MoE(config, dtype=dtype, mesh=mesh, rngs=rngs) if beside else None
        if beside:
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()
        # Gemma 4's per-layer input, gated into the residual after the layer.
        self.per_layer = (
            PerLayerInput(config, dtype=dtype, rngs=rngs) if config.per_layer_input_size else None
        )
        self.layer_scalar = param(rngs, (1,), (None,), dtype) if config.layer_scalar else None
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
        per_layer_input=None,
    ) -> tuple[jax.Array, ModelCache]:
        """`slots`: each request's state slots (`StateSlots`, for a linear layer); `q_scale`
        f32[T] the queries' temperature (Llama 4's layers without RoPE), or None;
        `per_layer_input` [T, P] this layer's slice of Gemma 4's per-layer inputs."""
        x, cache = self._block(x, ropes, cache, layer, meta, lora, slots, q_scale)
        if self.per_layer is not None:
            x = self.per_layer(x, per_layer_input)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar.get_value()
        return x, cache

    def _block(self, x, ropes, cache, layer, meta, lora, slots, q_scale):
        rope = ropes[1] if self.local_rope else ropes[0]
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            attn_out, linear = self.linear_attn(h, cache.linear, meta, slots)
            cache = dataclasses.replace(cache, linear=linear)
        elif isinstance(self.self_attn, MLAttention):
            attn_out, kv = self.self_attn(h, rope, cache.kv, layer, meta)
            cache = dataclasses.replace(cache, kv=kv)
        else:
            attn_out, kv = self.self_attn(h, rope, cache.kv, layer, meta, lora, q_scale)
            cache = dataclasses.replace(cache, kv=kv)
        # Adapters of a mixture of experts' MLPs are not served (`jaxllm.lora`).
        dense = lora is not None and not isinstance(self.mlp, MoE)
        mlp = functools.partial(self.mlp, lora=lora) if dense else self.mlp
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn_out)
            mlp_out = mlp(self.pre_feedforward_layernorm(x))
            if self.moe is not None:  # routed on the residual, the experts on its own norm
                routed = self.moe(self.pre_feedforward_layernorm_2(x), router_input=x)
                mlp_out = self.post_feedforward_layernorm_1(
                    mlp_out
                ) + self.post_feedforward_layernorm_2(routed)
            return x + self.post_feedforward_layernorm(mlp_out), cache
        x = x + attn_out
        return x + mlp(self.post_attention_layernorm(x)), cache


class PerLayerInput(nnx.Module):
    """Gemma 4's per-layer input inside a layer: x + norm(proj(act(gate(x)) * input))."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, p = config.hidden_size, config.per_layer_input_size
        self.per_layer_input_gate = param(rngs, (d, p), ("embed", None), dtype)
        self.per_layer_projection = param(rngs, (p, d), (None, "embed"), dtype)
        self.post_per_layer_input_norm = RMSNorm(
            d, config.rms_norm_eps, float_scale=config.norm_float_scale, dtype=dtype
        )
        self.act = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: jax.Array, per_layer_input: jax.Array) -> jax.Array:
        h = self.act(linear(x, self.per_layer_input_gate.get_value())) * per_layer_input
        h = linear(h, self.per_layer_projection.get_value())
        return x + self.post_per_layer_input_norm(h)


class PerLayerInputs(nnx.Module):
    """Gemma 4's per-layer inputs of a step's tokens, [T, L, P]: a second embedding of each
    token (scaled by sqrt(P)) and a projection of its first (scaled by 1 / sqrt(D), then
    normalised per layer), averaged as (a + b) / sqrt(2)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        d, p, n = config.hidden_size, config.per_layer_input_size, config.num_layers
        vocab = config.per_layer_vocab_size or config.vocab_size
        self.embed_tokens_per_layer = param(rngs, (vocab, n * p), ("vocab", None), dtype)
        self.per_layer_model_projection = param(rngs, (d, n * p), ("embed", None), dtype)
        self.per_layer_projection_norm = RMSNorm(
            p, config.rms_norm_eps, float_scale=config.norm_float_scale, axis=None, dtype=dtype
        )
        self.shape, self.hidden_size = (n, p), d

    def __call__(self, input_ids: jax.Array, embeds: jax.Array) -> jax.Array:
        table = self.embed_tokens_per_layer.get_value()
        vocab = table.shape[0]
        # Token ids past the table (multimodal placeholders) take row 0, as the pad token's.
        ids = jnp.where(input_ids < vocab, input_ids, 0)
        rows = take_rows(table, ids) if isinstance(table, QUANTIZED) else table[ids]
        n, p = self.shape
        tokens = rows * jnp.asarray(p**0.5, rows.dtype)
        projected = linear(embeds, self.per_layer_model_projection.get_value())
        projected = projected * jnp.asarray(self.hidden_size**-0.5, projected.dtype)
        projected = self.per_layer_projection_norm(projected.reshape(-1, n, p))
        both = projected + tokens.reshape(-1, n, p).astype(projected.dtype)
        return both * jnp.asarray(2.0**-0.5, both.dtype)


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
        self.per_layer_inputs = (
            PerLayerInputs(config, dtype=dtype, rngs=rngs) if config.per_layer_input_size else None
        )
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
        global_freq = rope_inv_freq(
            config.global_rotary_dim,
            config.rope_theta,
            config.rope_scaling,
            config.rope_freq_factors,
        )
        # The sliding layers' RoPE, where they have their own: its base, or its head width
        # (Gemma 4's are narrower than its full-attention layers').
        local = any(config.layer_uses_local_rope(i) for i in range(config.num_layers))
        local_freq = (
            rope_inv_freq(config.rotary_dim, config.rope_local_theta or config.rope_theta)
            if local
            else global_freq
        )
        self.inv_freq = (tuple(global_freq.tolist()), tuple(local_freq.tolist()))
        # YaRN's scale of cos and sin (the global RoPE's; the local one is never scaled).
        scaling = config.rope_scaling
        self.rope_scale = 1.0 if scaling is None else scaling.attention_factor
        self.mrope_section = config.mrope_section
        self.final_logit_softcapping = config.final_logit_softcapping
        # EAGLE-3's target: the residual stream entering these layers (num_layers: the last
        # layer's output before the norm) is returned beside the hidden states (static; see
        # `set_aux_hidden_state_layers`).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(
                rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dtype
            )

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Makes the forward pass return, after the cache, the residual stream entering each
        of `layers` (vLLM's ids: j is layer j - 1's output; `num_layers` the last layer's)
        concatenated in layer order, [T, len(layers) * D]: what an EAGLE-3 head reads."""
        if not all(0 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"aux hidden state layers {list(layers)} past the model's layers")
        self.aux_hidden_state_layers = tuple(layers)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]; with M-RoPE i32[3, T]
        cache: ModelCache,
        meta: AttentionMetadata,
        extras: StepExtras | None = None,
    ) -> tuple[jax.Array, ModelCache] | tuple[jax.Array, ModelCache, jax.Array]:
        """The hidden states of a step's tokens and the cache with their keys and values
        written (and the aux states, with `aux_hidden_state_layers`). `extras`: the served
        features' inputs (adapters, image embeddings)."""
        extras = extras or StepExtras()
        with using_kernels(self.compilation):
            cache = dataclasses.replace(cache, kv=as_kv_cache(cache.kv))
            return self._forward(input_ids, positions, cache, meta, extras)

    def _forward(self, input_ids, positions, cache: ModelCache, meta, extras: StepExtras):
        table = self.embed_tokens.get_value()
        x = take_rows(table, input_ids) if isinstance(table, QUANTIZED) else table[input_ids]
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, x.dtype)  # rounded to the dtype, as HF does
        # An image-text model's image embeddings taken instead of their placeholders'
        # embeddings (after the scaling: HF merges them into the scaled embeddings).
        if (mm_embeds := extras.image_embeds()) is not None:
            rows, index = mm_embeds
            image = rows[jnp.maximum(index, 0)].astype(x.dtype)
            x = jnp.where((index >= 0)[:, None], image, x)
        per_layer = None
        if self.per_layer_inputs is not None:
            per_layer = self.per_layer_inputs(input_ids, x)  # [T, L, P]
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
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                aux[i] = x
            with jax.named_scope(f"layer{i}"):
                x, cache = layer(
                    x,
                    ropes,
                    cache,
                    i,
                    meta,
                    loras[i],
                    extras.state_slots,
                    q_scale,
                    None if per_layer is None else per_layer[:, i],
                )
        if not self.aux_hidden_state_layers:
            return self.norm(x), cache
        aux[len(self.layers)] = x
        states = [aux[i] for i in sorted(set(self.aux_hidden_state_layers))]  # (vLLM's order)
        return self.norm(x), cache, jnp.concatenate(states, axis=-1)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        with using_kernels(self.compilation):
            return self._logits(hidden)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            table = self.embed_tokens.get_value()
            if isinstance(table, QUANTIZED):  # [V, D] is already the head's [O, I]
                logits = qmatmul(hidden, table)
            else:
                logits = matmul(hidden, table, w_transposed=True)
        else:
            logits = linear(hidden, self.lm_head.get_value())
        logits = logits.astype(jnp.float32)
        cap = self.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
