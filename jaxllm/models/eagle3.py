"""EAGLE-3's draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), as vLLM's `Eagle3LlamaForCausalLM` runs it.

The head reads three of the target's hidden states per token (the residual stream entering
the layers `aux_layers` names: vLLM's `eagle_aux_hidden_state_layer_ids`, id j being the output
of layer j - 1) and proposes the token after next:

    g = fc([a_1; a_2; a_3])                                 (once per target token)
    x = [input_layernorm(embed(t_next)); hidden_norm(g)]    (2D wide)
    r = g  (or hidden_norm(g) with `norm_before_residual`)
    h = self_attn(x) + r;  out = mlp(post_attention_layernorm(h)) + h
    logits = lm_head(norm(out))  over the draft vocabulary; target id = id + d2t[id]

`out` before the final norm stands in for the target's hidden state at the next position when
the head drafts again from its own token (the "training-time test"). Its one attention layer
keeps its own paged KV cache on the target's pages (`jaxllm.worker.spec_decode.heads`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import REFERENCE_KERNELS, CompilationConfig, ModelConfig, using_kernels
from jaxllm.models.layers import (
    MLP,
    Attention,
    AttentionMetadata,
    RMSNorm,
    Rope,
    linear,
    param,
    rope_inv_freq,
)
from jaxllm.models.state import ModelCache
from jaxllm.quantization import QUANTIZED, take_rows
from pallas_kernels import as_kv_cache

# The architectures a head's config.json names (vLLM's registry), and the speculators
# library's format, which nests the layer's config.
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer as a one-layer Llama
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target's residual stream entering these layers
    norm_before_residual: bool = False
    has_embeddings: bool = False  # its own embed_tokens; else the target's
    has_d2t: bool = False  # a d2t map (a draft vocabulary smaller than the target's)
    method = "eagle3"  # the proposer's program names

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def aux_width(self) -> int:
        """The width of the target states it reads per token: three of them."""
        return 3 * self.target_hidden_size

    @classmethod
    def from_hf_config(
        cls, raw: dict[str, Any], target: ModelConfig, tensor_names: set[str]
    ) -> Eagle3Config:
        """The head's setup from its config.json (`raw`), for `target`, checked against it,
        each problem named. `tensor_names`: the checkpoint's tensors (which optional ones it
        has)."""
        where = "speculative_config: the eagle3 head's config.json"
        layer = dict(raw.get("transformer_layer_config") or raw)
        archs = raw.get("architectures") or []
        if raw.get("speculators_model_type", "eagle3") != "eagle3" or (
            archs and not set(archs) & set(ARCHITECTURES)
        ):
            raise ValueError(
                f"{where} names {archs or raw.get('speculators_model_type')!r}, not an EAGLE-3 "
                f"head ({', '.join(ARCHITECTURES)})"
            )
        eagle = raw.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ValueError(f"{where}: use_aux_hidden_state false (EAGLE-1/2 style) is not served")
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size")
                   if k not in layer]  # fmt: skip
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        num_layers = layer.get("num_hidden_layers", 1)
        if num_layers != 1:
            raise ValueError(f"{where}: num_hidden_layers {num_layers}; heads of 1 layer only")
        vocab = layer.get("vocab_size", target.vocab_size)
        if vocab != target.vocab_size:
            raise ValueError(
                f"{where}: vocab_size {vocab} differs from the target's {target.vocab_size}"
            )
        draft_vocab = raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab
        target_hidden = raw.get("target_hidden_size") or layer.get("target_hidden_size")
        target_hidden = target_hidden or layer["hidden_size"]
        if target_hidden != target.hidden_size:
            raise ValueError(
                f"{where}: target_hidden_size {target_hidden} differs from the target's "
                f"hidden_size {target.hidden_size}"
            )
        aux = (
            raw.get("eagle_aux_hidden_state_layer_ids")
            or eagle.get("eagle_aux_hidden_state_layer_ids")
            or default_aux_layers(target.num_layers)
        )
        aux = tuple(sorted(int(i) for i in aux))  # vLLM takes them in layer order
        if len(set(aux)) != 3 or not all(0 <= i <= target.num_layers for i in aux):
            raise ValueError(
                f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} must be 3 distinct layer "
                f"ids in [0, {target.num_layers}] (the target's layers; vLLM's default for "
                f"{target.num_layers} layers is {list(default_aux_layers(target.num_layers))})"
            )
        has_embeddings = "embed_tokens.weight" in tensor_names
        if not has_embeddings and layer["hidden_size"] != target.hidden_size:
            raise ValueError(
                f"{where}: hidden_size {layer['hidden_size']} differs from the target's "
                f"{target.hidden_size}, and the head has no embed_tokens of its own to use"
            )
        layer |= {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
        layer["vocab_size"] = target.vocab_size
        layer.pop("sliding_window", None)
        has_d2t = "d2t" in tensor_names
        if not 1 <= draft_vocab <= target.vocab_size:
            raise ValueError(
                f"{where}: draft_vocab_size {draft_vocab} must be in [1, {target.vocab_size}] "
                "(the target's vocabulary)"
            )
        if draft_vocab != target.vocab_size and not has_d2t:
            raise ValueError(
                f"{where}: draft_vocab_size {draft_vocab} is not the target's vocabulary "
                f"({target.vocab_size}) and the checkpoint has no d2t map"
            )
        return cls(
            layer=ModelConfig.from_hf_config(layer),
            draft_vocab_size=int(draft_vocab),
            target_hidden_size=int(target_hidden),
            aux_layers=aux,
            norm_before_residual=bool(
                raw.get("norm_before_residual", layer.get("norm_before_residual", False))
            ),
            has_embeddings=has_embeddings,
            has_d2t=has_d2t,
        )


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's choice when a head names none (`get_eagle3_aux_hidden_state_layers`)."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nnx.Module):
    def __init__(
        self,
        config: Eagle3Config,
        *,
        dtype=jnp.float32,
        compilation: CompilationConfig = REFERENCE_KERNELS,
        mesh=None,
        rngs: nnx.Rngs | None,
    ):
        c = config.layer
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.compilation = compilation
        self.norm_before_residual = config.norm_before_residual
        self.fc = param(rngs, (3 * config.target_hidden_size, d), (None, "embed"), dtype)
        self.embed_tokens = (
            param(rngs, (c.vocab_size, d), ("vocab", "embed"), dtype)
            if config.has_embeddings
            else None
        )

        def norm():
            return RMSNorm(d, c.rms_norm_eps, dtype=dtype)

        self.input_layernorm, self.hidden_norm = norm(), norm()
        self.self_attn = Attention(c, 0, dtype=dtype, mesh=mesh, rngs=rngs)
        # Its projections read the token's embedding and the hidden state side by side.
        self.self_attn.q_proj = param(rngs, (2 * d, n * h), ("embed", "q_heads"), dtype)
        self.self_attn.k_proj = param(rngs, (2 * d, k * h), ("embed", "kv_heads"), dtype)
        self.self_attn.v_proj = param(rngs, (2 * d, k * h), ("embed", "kv_heads"), dtype)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(c, dtype=dtype, rngs=rngs)
        self.norm = norm()
        self.lm_head = param(rngs, (d, config.draft_vocab_size), ("embed", "vocab"), dtype)
        # Draft id -> target id offsets (int32: ids fit); zeros without a map.
        self.d2t = nnx.Param(jnp.zeros((config.draft_vocab_size,), jnp.int32), axes=(None,))
        self.inv_freq = tuple(
            rope_inv_freq(
                c.global_rotary_dim, c.rope_theta, c.rope_scaling, c.rope_freq_factors
            ).tolist()
        )
        self.rope_scale = 1.0 if c.rope_scaling is None else c.rope_scaling.attention_factor

    def attend_within(self, window: int | None) -> None:
        """Attend to the last `window` positions only (None: all)."""
        self.self_attn.sliding_window = window

    def combine(self, aux: jax.Array) -> jax.Array:
        """[T, 3 * target D] -> [T, D]: the target's states fused (once per target token)."""
        return linear(aux.astype(self.fc.get_value().dtype), self.fc.get_value())

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]: the next token of each position
        positions: jax.Array,  # i32[T]
        hidden: jax.Array,  # [T, D]: the fused target states, or the head's own `prenorm`
        cache: ModelCache,
        meta: AttentionMetadata,
        embed_table: jax.Array,  # the target's embeddings, used when the head has none
    ) -> tuple[jax.Array, jax.Array, ModelCache]:
        """(the final hidden states [T, D], before the final norm [T, D], the cache)."""
        with using_kernels(self.compilation):
            cache = dataclasses.replace(cache, kv=as_kv_cache(cache.kv))
            table = embed_table if self.embed_tokens is None else self.embed_tokens.get_value()
            rows = take_rows(table, input_ids) if isinstance(table, QUANTIZED) else table[input_ids]
            embeds = rows.astype(hidden.dtype)
            if self.norm_before_residual:
                residual = g = self.hidden_norm(hidden)
            else:
                residual, g = hidden, self.hidden_norm(hidden)
            x = jnp.concatenate([self.input_layernorm(embeds), g], axis=-1)
            rope = Rope.at(positions, self.inv_freq, None, self.rope_scale)
            attn, kv = self.self_attn(x, rope, cache.kv, 0, meta)
            h = attn + residual
            out = self.mlp(self.post_attention_layernorm(h)) + h
            return self.norm(out), out, dataclasses.replace(cache, kv=kv)

    def draft_logits(self, hidden: jax.Array, embed_table: jax.Array | None = None) -> jax.Array:
        """f32[R, draft vocabulary] from final hidden states [R, D] (its own head always)."""
        with using_kernels(self.compilation):
            return linear(hidden, self.lm_head.get_value()).astype(jnp.float32)

    def to_target(self, ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids as the target's ids."""
        return ids + self.d2t.get_value()[ids]


def tensor_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors as vLLM's loader reads them (names after its renaming of
    `midlayer.` to `layers.0.`, without its `model.` prefix), torch [out, in] shapes."""
    c = config.layer
    d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    layer = {
        "input_layernorm.weight": (d,),
        "hidden_norm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (n * h, 2 * d),
        "self_attn.k_proj.weight": (k * h, 2 * d),
        "self_attn.v_proj.weight": (k * h, 2 * d),
        "self_attn.o_proj.weight": (d, n * h),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    shapes = {f"layers.0.{name}": shape for name, shape in layer.items()}
    shapes |= {
        "fc.weight": (d, 3 * config.target_hidden_size),
        "norm.weight": (d,),
        "lm_head.weight": (config.draft_vocab_size, d),
    }
    if config.has_embeddings:
        shapes["embed_tokens.weight"] = (c.vocab_size, d)
    if config.has_d2t:
        shapes["d2t"] = (config.draft_vocab_size,)
    return shapes
