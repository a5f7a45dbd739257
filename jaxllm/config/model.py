"""The network's shape: `ModelConfig`, one frozen dataclass validated on construction, built
from a Hugging Face `config.json` (`from_hf_config`, read by the family records:
`jaxllm.families.hf_config`), from GGUF metadata in the same keys, or by hand."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxllm.families import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
)
from jaxllm.families.hf_config import (
    LatentAttention,
    LinearAttention,
    RopeScaling,
    model_config_fields,
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer: the Llama layout plus the switches other
    families need (each family's record in `jaxllm.families`, its `features`, says which it
    turns on)."""

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
    """Per layer, "full_attention", "sliding_attention", "chunked_attention" (Llama 4) or
    "linear_attention" (a hybrid's); empty: every layer slides when `sliding_window` is
    set."""
    attention_chunk_size: int | None = None
    """Llama 4's chunked local attention: a query of a "chunked_attention" layer sees only the
    keys of its own chunk of this many positions."""
    nope_layers: tuple[int, ...] = ()
    """Layers without RoPE (Llama 4's `no_rope_layers` zeros)."""
    rope_interleaved: bool = False
    """RoPE turns adjacent channel pairs (2i, 2i + 1) of each head (Llama 4), not (i, i + H/2):
    the loader reorders q and k's channels per head so the decoder's RoPE applies (a
    permutation of both leaves every score unchanged)."""
    qk_l2_norm: bool = False
    """Queries and keys of the RoPE layers normalised to unit RMS over each head, without a
    weight, after RoPE (Llama 4's `use_qk_norm`)."""
    attn_temperature_tuning: bool = False
    """Queries of the layers without RoPE scaled by log1p(floor((pos + 1) / floor_scale)) *
    attn_scale + 1 (Llama 4)."""
    attn_scale: float = 0.1
    floor_scale: float = 8192.0
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
    norm_float_scale: bool = False
    """RMSNorm multiplies by its weight in float32 and casts last (gpt-oss), rather than casting
    to the activations' dtype first (Llama)."""
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
    attention_output_gate: bool = False
    """The query projection also yields a per-channel gate; the attention output is
    multiplied by its sigmoid before the output projection (Qwen3-Next, Qwen3.5)."""
    partial_rotary_factor: float = 1.0
    """RoPE turns the first `head_dim * factor` channels of each head; the rest pass."""
    linear_attention: LinearAttention | None = None
    """The shape of the "linear_attention" layers of a hybrid model; None without them."""
    shared_expert_intermediate_size: int = 0
    """A mixture of experts' shared expert, added to the routed ones through a sigmoid gate
    (Qwen3-Next, Qwen3.5-MoE), or as it is (`shared_expert_gated` False: Llama 4); 0: none."""
    shared_expert_gated: bool = True
    router_sigmoid: bool = False
    """Routing weights are the sigmoid of the top-k router logits (Llama 4), not a softmax."""
    moe_weight_inputs: bool = False
    """Each chosen expert takes its input times its routing weight, and its output is summed
    as it is (Llama 4), rather than weighting the outputs."""
    attention_sinks: bool = False
    """Each attention layer has a learned logit per query head that joins its softmax's
    denominator (gpt-oss's `sinks`)."""
    router_bias: bool = False
    """The mixture of experts' router has a bias (gpt-oss)."""
    expert_bias: bool = False
    """Each expert's gate, up and down projections have biases (gpt-oss)."""
    swiglu_limit: float | None = None
    """The experts' gate is gpt-oss's clamped SwiGLU: gate clamped to <= limit, up to
    [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate); None: the usual
    act(gate) * up."""
    swiglu_alpha: float = 1.702
    global_head_dim: int | None = None
    """The head width of the full-attention layers where it differs from `head_dim` (Gemma 4:
    512 beside its sliding layers' 256)."""
    num_global_kv_heads: int | None = None
    """The kv heads of the full-attention layers where they differ (Gemma 4)."""
    attention_k_eq_v: bool = False
    """The full-attention layers have no v projection: their values are the k projection's
    output, normalised without RoPE (Gemma 4)."""
    v_norm: bool = False
    """Values are RMS-normalised over each head without a weight (Gemma 4)."""
    kv_shared_layers: int = 0
    """The last this many layers keep no keys and values: each attends to those of the last
    earlier layer of its kind (Gemma 4's `num_kv_shared_layers`)."""
    double_wide_mlp: bool = False
    """The layers that share another's KV have an MLP twice `intermediate_size` (Gemma 4)."""
    per_layer_input_size: int = 0
    """Gemma 4's per-layer inputs: a second embedding of each token, this wide per layer, plus
    a projection of the first, gated into the residual after every layer; 0: none."""
    per_layer_vocab_size: int = 0
    """The rows of the per-layer embedding table (`vocab_size_per_layer_input`)."""
    layer_scalar: bool = False
    """Each layer's output is multiplied by a learned scalar of the layer (Gemma 4)."""
    moe_beside_mlp: bool = False
    """Gemma 4's MoE block: every layer has the dense MLP and a mixture of experts side by side,
    the router reading the normalised residual scaled per channel, a scale per expert."""
    latent_attention: LatentAttention | None = None
    """Every attention layer is multi-head latent attention (DeepSeek-V2/V3): `head_dim` is
    its RoPE key's width, and the cache keeps one [latent | RoPE key] row per token
    (`layer_head_dim` is half of it, as if the row were a key and a value: see
    `pallas_kernels.mla_attention` for the pages, which pair rows)."""
    router_scoring: str = "softmax"
    """How the router scores experts: "softmax" over all logits, or "sigmoid" of each
    (DeepSeek-V3), chosen with `router_score_bias` and renormalised as `moe_renormalize`
    says."""
    router_score_bias: bool = False
    """Each expert's score gets a learned bias for choosing experts only; the weights stay the
    unbiased scores (DeepSeek-V3's `e_score_correction_bias`)."""
    expert_groups: int = 1
    """The experts fall into this many groups, and a token chooses its experts within the
    best `expert_groups_kept` of them: scored by their best expert (DeepSeek-V2's
    group_limited_greedy), or with a score bias by the sum of their two best (V3's)."""
    expert_groups_kept: int = 1
    routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this (DeepSeek)."""
    router_float32: bool = False
    """The router's weight and score bias are kept and applied in float32 whatever the
    model's dtype (DeepSeek's, as transformers keeps them)."""
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
        kinds = {FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION, CHUNKED_ATTENTION}
        bad = set(self.layer_types) - kinds
        if bad:
            raise ValueError(f"model config: unsupported layer_types {sorted(bad)}")
        if (CHUNKED_ATTENTION in self.layer_types) and not (self.attention_chunk_size or 0) >= 1:
            raise ValueError(
                "model config: chunked_attention layers need attention_chunk_size >= 1, got "
                f"{self.attention_chunk_size}"
            )
        if (LINEAR_ATTENTION in self.layer_types) != (self.linear_attention is not None):
            raise ValueError(
                "model config: linear_attention layers need their shape (linear_num_key_heads, "
                "linear_key_head_dim, ...) and the shape needs such layers"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"model config: partial_rotary_factor {self.partial_rotary_factor} must give an "
                f"even number of rotated channels in (0, head_dim]"
            )
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
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(
                f"model config: router_scoring must be softmax or sigmoid, got "
                f"{self.router_scoring!r}"
            )
        if self.num_experts and not (
            1 <= self.expert_groups_kept <= self.expert_groups
            and self.num_experts % self.expert_groups == 0
            and self.num_experts_per_tok
            <= self.expert_groups_kept * (self.num_experts // self.expert_groups)
        ):
            raise ValueError(
                f"model config: {self.num_experts} experts in n_group={self.expert_groups} "
                f"groups, topk_group={self.expert_groups_kept} kept, must be whole groups "
                f"holding num_experts_per_tok={self.num_experts_per_tok} experts"
            )
        if self.latent_attention is not None:
            if self.layer_types and set(self.layer_types) != {FULL_ATTENTION}:
                raise ValueError("model config: latent attention layers are full attention")
            if self.num_kv_heads != self.kv_head_replicas:
                raise ValueError(
                    "model config: latent attention keeps one latent per token (num_kv_heads "
                    f"1, or its copies under tensor parallelism), got {self.num_kv_heads}"
                )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError("model config: moe_intermediate_size must be >= 1")
        if not 0 <= self.kv_shared_layers < self.num_layers:
            raise ValueError(
                f"model config: kv_shared_layers must be in [0, {self.num_layers}), got "
                f"{self.kv_shared_layers}"
            )
        for i in self.attention_layers:
            if self.num_heads % self.layer_num_kv_heads(i):
                raise ValueError(
                    f"model config: layer {i}'s {self.layer_num_kv_heads(i)} kv heads must "
                    f"divide num_heads ({self.num_heads})"
                )
            if self.layer_kv_source(i) is None:
                raise ValueError(
                    f"model config: layer {i} shares the KV of an earlier {self.layer_kind(i)} "
                    "layer, and there is none"
                )
        widths = sorted({self.layer_head_dim(i) for i in self.kv_layers})
        if any(widths[-1] % w for w in widths):
            raise ValueError(f"model config: head widths {widths} must each divide the widest")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer`; None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of `layer` (Llama 4's chunked layers); None elsewhere."""
        if self.layer_types and self.layer_types[layer] == CHUNKED_ATTENTION:
            return self.attention_chunk_size
        return None

    def layer_kv_reach(self, layer: int) -> int | None:
        """How many positions back `layer`'s queries may see, for what the cache must keep: its
        window, or its attention chunk (a chunk starts at most C - 1 positions back); None:
        every position."""
        return self.layer_window(layer) or self.layer_chunk(layer)

    def layer_kind(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def _global(self, layer: int) -> bool:
        return self.layer_kind(layer) == FULL_ATTENTION

    @property
    def full_head_dim(self) -> int:
        """The head width of the full-attention layers (Gemma 4's `global_head_dim`)."""
        return self.global_head_dim or self.head_dim

    def layer_head_dim(self, layer: int) -> int:
        """The width of `layer`'s keys and values in the cache: its head's; a latent
        attention layer's row [latent | RoPE key] counts as a key and a value half as wide."""
        if self.latent_attention is not None:
            return -(-self.latent_attention.row_width(self.head_dim) // 2)  # an odd row: + 1/2
        return self.full_head_dim if self._global(layer) else self.head_dim

    def layer_num_kv_heads(self, layer: int) -> int:
        if self._global(layer) and self.num_global_kv_heads:
            return self.num_global_kv_heads * self.kv_head_replicas
        return self.num_kv_heads

    def layer_num_heads_per_kv(self, layer: int) -> int:
        return self.num_heads // self.layer_num_kv_heads(layer)

    def layer_kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values `layer` attends to: itself, or for one of the last
        `kv_shared_layers` the last earlier layer of its kind that keeps its own (None: there
        is none, a bad config)."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_kind(layer)
        return next(
            (i for i in range(first_shared - 1, -1, -1) if self.layer_kind(i) == kind), None
        )

    @property
    def heads_vary_by_layer(self) -> bool:
        """Some attention layer's head width or kv heads differ from `head_dim` and
        `num_kv_heads` (Gemma 4's full-attention layers; not latent attention, whose layers
        are all alike)."""
        if self.latent_attention is not None:
            return False
        return any(
            (self.layer_head_dim(i), self.layer_num_kv_heads(i))
            != (self.head_dim, self.num_kv_heads)
            for i in self.attention_layers
        )

    # The cache layout's derived figures are computed once per config (a frozen dataclass:
    # `cached_property` stores them beside the fields), not once per call: kv_cache_groups of
    # Gemma 4 31B took 0.13 s of recomputation.
    @functools.cached_property
    def kv_layers(self) -> tuple[int, ...]:
        """The attention layers that keep keys and values of their own in the paged cache."""
        return tuple(i for i in self.attention_layers if self.layer_kv_source(i) == i)

    @functools.cached_property
    def cache_head_dim(self) -> int:
        """The head width of the cache's rows: the widest layer's. A narrower layer packs
        `layer_kv_pack` of its heads into one row (see `jaxllm.models.kv_layout`)."""
        return max((self.layer_head_dim(i) for i in self.kv_layers), default=self.head_dim)

    def layer_kv_pack(self, layer: int) -> int:
        """How many of `layer`'s kv heads share one row of the cache."""
        return self.cache_head_dim // self.layer_head_dim(layer)

    def layer_packed_kv_heads(self, layer: int) -> int:
        """`layer`'s kv heads as the cache holds them: packed `layer_kv_pack` to a row."""
        return -(-self.layer_num_kv_heads(layer) // self.layer_kv_pack(layer))

    @functools.cached_property
    def cache_kv_heads(self) -> int:
        """The kv heads of one cache slot: every layer's packed heads are a whole number of
        slots (`layer_kv_parts`)."""
        return math.gcd(*(self.layer_packed_kv_heads(i) for i in self.kv_layers)) or 1

    def layer_kv_parts(self, layer: int) -> int:
        """How many cache slots `layer`'s keys and values fill (1 but for a layer with more
        kv width than another's, Gemma 4's sliding layers)."""
        return self.layer_packed_kv_heads(layer) // self.cache_kv_heads

    def layer_intermediate_size(self, layer: int) -> int:
        """The dense MLP's width in `layer` (Gemma 4's KV-sharing layers: twice, with
        `double_wide_mlp`)."""
        wide = self.double_wide_mlp and self.layer_kv_source(layer) != layer
        return self.intermediate_size * (2 if wide else 1)

    def layer_uses_rope(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def layer_is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer: a recurrent state per request, no KV cache."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the paged cache."""
        return tuple(i for i in range(self.num_layers) if not self.layer_is_linear(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state per request instead."""
        return tuple(i for i in range(self.num_layers) if self.layer_is_linear(i))

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that RoPE turns (in a layer of `head_dim`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def global_rotary_dim(self) -> int:
        """The channels RoPE turns in the full-attention layers (`global_head_dim` wide)."""
        return int(self.full_head_dim * self.partial_rotary_factor)

    def layer_uses_local_rope(self, layer: int) -> bool:
        """The sliding layers' RoPE: its own base (Gemma 3), or `head_dim` wide beside wider
        full-attention heads (Gemma 4)."""
        if self.layer_window(layer) is None:
            return False
        return self.rope_local_theta is not None or self.layer_head_dim(layer) != self.full_head_dim

    def layer_is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | Any) -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` (a dict or a PretrainedConfig),
        read by its family's record (`jaxllm.families.hf_config`). GGUF metadata arrives here
        too, as the same keys (plus `rope_freq_factors`)."""
        return cls(**model_config_fields(config))
