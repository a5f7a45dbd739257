"""A checkpoint's own multi-token-prediction layer as a draft head (DeepSeek-V3's MTP, as
vLLM's `DeepSeekMTP` runs it with `{"method": "mtp"}`).

DeepSeek-V3 ships, after its `num_hidden_layers` decoder layers, `num_nextn_predict_layers`
MTP modules (`model.layers.{L}.*`), trained to predict the token after next:

    x = eh_proj([enorm(embed(t_next)); hnorm(h)])    h: the target's final (normed) state
    out = decoder_layer(x)                            (a layer of the target's own kind)
    logits = shared_head.head(shared_head.norm(out))

with the embedding zeroed at position 0 (vLLM's masking). `out` stands in for the target's
state when the layer drafts again from its own token: K drafts repeat the first MTP layer, as
vLLM's proposer does (the others are not read). The head keeps its own paged KV cache of its
one layer on the target's pages; `embed_tokens` and `shared_head.head` are the layer's own
where the checkpoint has them, else the target's (vLLM shares them then too).

The proposer is EAGLE-3's (`jaxllm.worker.spec_decode.heads`), which drives any head of this
interface: `attend_within`, `combine`, `__call__`, `draft_logits`, `to_target`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import REFERENCE_KERNELS, CompilationConfig, ModelConfig, using_kernels
from jaxllm.models.decoder import DecoderLayer
from jaxllm.models.layers import AttentionMetadata, RMSNorm, Rope, linear, param, rope_inv_freq
from jaxllm.models.state import ModelCache
from jaxllm.quantization import QUANTIZED, take_rows
from pallas_kernels import as_kv_cache

# The targets whose MTP layers are served (the hybrids' wait for their speculation).
ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# The layer's tensors outside its decoder block (vLLM's `spec_layer_weight_names`).
OWN_TENSORS = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
    "embed_tokens.weight",
)


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    layer: ModelConfig  # the MTP block as a one-layer model of the target's kind
    layer_index: int  # where the checkpoint keeps it: model.layers.{layer_index}
    has_embeddings: bool = True  # its own embed_tokens; else the target's
    has_head: bool = True  # its own shared_head.head; else the target's output head
    method = "mtp"  # the proposer's program names

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def aux_width(self) -> int:
        """The width of the target states it reads per token: the final hidden state."""
        return self.layer.hidden_size

    @classmethod
    def from_hf_config(
        cls, raw: dict[str, Any], target: ModelConfig, tensor_names: set[str] | None
    ) -> MTPConfig:
        """The MTP layer of the target whose config.json is `raw` (`target` as loaded, sharded
        or not), each problem named. `tensor_names`: the layer's tensors, without the
        `model.layers.{L}.` prefix (None: a config alone, as `jaxllm compile` reads, taken
        to have them all)."""
        where = "speculative_config: method mtp"
        if target.architecture not in ARCHITECTURES:
            raise ValueError(
                f"{where} serves the multi-token-prediction layers of "
                f"{', '.join(ARCHITECTURES)} checkpoints, not {target.architecture}"
            )
        n = raw.get("num_nextn_predict_layers") or 0
        if n < 1:
            raise ValueError(
                f"{where}: the checkpoint has no multi-token-prediction layers "
                f"(num_nextn_predict_layers is {n} in its config.json)"
            )
        index = target.num_layers
        if tensor_names is not None:
            missing = [t for t in OWN_TENSORS[:3] if t not in tensor_names]
            if missing or not any(t.startswith("self_attn.") for t in tensor_names):
                raise ValueError(
                    f"{where}: the checkpoint's MTP layer model.layers.{index} lacks "
                    f"{', '.join(missing) or 'its attention'} (the target's weights must "
                    "include it: some conversions drop it)"
                )
        # DeepSeek's rule for a layer's MLP, applied to the MTP layer's index.
        experts = raw.get("n_routed_experts") or 0
        first = raw.get("first_k_dense_replace") or 0
        freq = raw.get("moe_layer_freq") or 1
        moe = experts > 0 and index >= first and index % freq == 0
        layer = dataclasses.replace(
            target, num_layers=1, dense_layers=() if moe else (0,), layer_types=()
        )
        names = OWN_TENSORS if tensor_names is None else tensor_names
        if target.tie_word_embeddings and "shared_head.head.weight" not in names:
            raise ValueError(f"{where}: the MTP layer has no shared_head.head of its own")
        return cls(
            layer=layer,
            layer_index=index,
            has_embeddings="embed_tokens.weight" in names,
            has_head="shared_head.head.weight" in names,
        )


class SharedHead(nnx.Module):
    def __init__(self, config: MTPConfig, *, dtype, rngs: nnx.Rngs | None):
        c = config.layer
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.head = (
            param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), dtype)
            if config.has_head
            else None
        )


class MTPHead(nnx.Module):
    def __init__(
        self,
        config: MTPConfig,
        *,
        dtype=jnp.float32,
        compilation: CompilationConfig = REFERENCE_KERNELS,
        mesh=None,
        rngs: nnx.Rngs | None,
    ):
        c = config.layer
        d = c.hidden_size
        self.compilation = compilation
        self.embed_tokens = (
            param(rngs, (c.vocab_size, d), ("vocab", "embed"), dtype)
            if config.has_embeddings
            else None
        )
        self.enorm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.eh_proj = param(rngs, (2 * d, d), (None, "embed"), dtype)
        # `layers.0` as the target's loader names a layer's parameters (`loaders.mtp`).
        self.layers = nnx.List([DecoderLayer(c, 0, dtype=dtype, mesh=mesh, rngs=rngs)])
        self.shared_head = SharedHead(config, dtype=dtype, rngs=rngs)
        self.inv_freq = tuple(
            rope_inv_freq(
                c.global_rotary_dim, c.rope_theta, c.rope_scaling, c.rope_freq_factors
            ).tolist()
        )
        self.rope_scale = 1.0 if c.rope_scaling is None else c.rope_scaling.attention_factor

    def attend_within(self, window: int | None) -> None:
        """The targets served attend to every position (latent attention has no window)."""
        if window is not None:
            raise ValueError("speculative_config: an MTP layer over sliding layers only")

    def combine(self, aux: jax.Array) -> jax.Array:
        """The target's states as the head reads them: its final hidden states, as they are."""
        return aux

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]: the next token of each position
        positions: jax.Array,  # i32[T]
        hidden: jax.Array,  # [T, D]: the target's final states, or the head's own `prenorm`
        cache: ModelCache,
        meta: AttentionMetadata,
        shared: tuple[jax.Array, jax.Array],  # the target's (embeddings, output head)
    ) -> tuple[jax.Array, jax.Array, ModelCache]:
        """(the states after the shared head's norm [T, D], before it [T, D], the cache)."""
        with using_kernels(self.compilation):
            cache = dataclasses.replace(cache, kv=as_kv_cache(cache.kv))
            table = shared[0] if self.embed_tokens is None else self.embed_tokens.get_value()
            rows = take_rows(table, input_ids) if isinstance(table, QUANTIZED) else table[input_ids]
            embeds = jnp.where((positions == 0)[:, None], 0, rows.astype(hidden.dtype))
            x = jnp.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1)
            x = linear(x, self.eh_proj.get_value())
            rope = Rope.at(positions, self.inv_freq, None, self.rope_scale)
            out, cache = self.layers[0](x, (rope, rope), cache, 0, meta, None, None)
            return self.shared_head.norm(out), out, cache

    def draft_logits(self, hidden: jax.Array, shared: tuple[jax.Array, jax.Array]) -> jax.Array:
        """f32[R, vocabulary] from the shared head's normed states [R, D]."""
        with using_kernels(self.compilation):
            own = self.shared_head.head
            head = shared[1] if own is None else own.get_value()
            return linear(hidden, head).astype(jnp.float32)

    def to_target(self, ids: jax.Array) -> jax.Array:
        return ids  # the target's vocabulary already
