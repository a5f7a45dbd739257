"""Building blocks of a Llama-family decoder, in Flax NNX.

Dimension letters (used in einsums, shape comments and logical axis names): T tokens,
D model width, F MLP width, V vocab, N query heads, K kv heads, H head dim, R requests,
P pages per sequence.

Every parameter is declared once with its shape and its logical axes (`axes=` metadata);
the sharding rules table maps those names onto mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxllm.config import ModelConfig, RopeScaling, kernel_choices
from jaxllm.families import FULL_ATTENTION
from jaxllm.models.kv_layout import KVLayout
from jaxllm.quantization import QUANTIZED, QArray, SplitRows, qmatmul, qmatmuls
from jaxllm.sharding import kv_cache_specs
from pallas_kernels import KVCache


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str, ...], dtype, scale=0.02):
    """A parameter with its logical axes: random with `rngs`, zeros without (weights a loader
    fills in; building the model's shapes without tracing ~300 random initializers saves most
    of a second at every start)."""
    assert len(shape) == len(axes), (shape, axes)
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype), axes=axes)
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0, float_scale: bool = False
) -> jax.Array:
    """x normalised over its last axis in float32, scaled by (offset + weight): offset 0 (Llama)
    casts back to x's dtype before the scale, as transformers does; offset 1 (Gemma, whose
    weights start at zero), and `float_scale` (gpt-oss), scale in float32 and cast last."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset or float_scale:
        return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """x scaled to unit RMS over its last axis in float32, no weight (Llama 4's q/k norm)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, scaled by (offset + weight) (`rms_norm`)."""

    def __init__(
        self,
        dim: int,
        eps: float,
        *,
        offset: float = 0.0,
        float_scale: bool = False,
        axis: str = "embed",
        dtype,
    ):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype), axes=(axis,))
        self.eps = eps
        self.offset = offset
        self.float_scale = float_scale

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight.get_value(), self.eps, self.offset, self.float_scale)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with weight and bias, computed in float32 (BERT's and the
    vision towers')."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), axes=("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight.get_value() + self.bias.get_value()).astype(x.dtype)


# The gate activations, by their Hugging Face names (torch's tanh GELU is JAX's approximate one).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> np.ndarray:
    """Inverse frequencies f32[H // 2]: scaled as `scaling` says ("linear", "llama3", "yarn"
    or "proportional"), or divided by llama.cpp's per-frequency `freq_factors`. (YaRN's scale of cos and
    sin is `scaling.attention_factor`, applied by `Rope.at`.)"""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if freq_factors is not None:
        if len(freq_factors) != len(inv_freq):
            raise ValueError(
                f"rope_freq_factors has {len(freq_factors)} entries; head_dim {head_dim} needs "
                f"{len(inv_freq)}"
            )
        return (inv_freq / np.asarray(freq_factors, np.float32)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if scaling.rope_type == "proportional":  # as transformers computes it
        turning = int(scaling.partial_rotary_factor * head_dim // 2)
        inv_freq[turning:] = 0.0
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(
    extrapolated: np.ndarray, dim: int, theta: float, scaling: RopeScaling
) -> np.ndarray:
    """YaRN's blend, as transformers computes it (`_compute_yarn_parameters`): frequencies that
    turn more than `beta_fast` times over the original context keep their value, those under
    `beta_slow` are divided by the factor, and a linear ramp over dimensions joins them."""

    def correction_dim(rotations: float) -> float:
        length = scaling.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolated (unscaled), 0: interpolated
    interpolated = (extrapolated / np.float32(scaling.factor)).astype(np.float32)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding of this step's positions, computed once per forward pass and
    shared by every layer (per layer it was 60 cos/sin evaluations a step, and a third of the
    time JAX spent tracing the model)."""

    cos: jax.Array  # f32[T, H]
    sin: jax.Array  # f32[T, H]

    @classmethod
    def at(
        cls,
        positions: jax.Array,
        inv_freq: tuple[float, ...],
        sections: tuple[int, ...] | None = None,
        scale: float = 1.0,
    ) -> Rope:
        """`positions` i32[T], or with M-RoPE's `sections` i32[3, T]: frequency j turns with
        the component of the section it falls in (time, row, column). `scale` multiplies cos
        and sin (YaRN's attention factor)."""
        if sections is not None:
            component = np.repeat(np.arange(len(sections)), sections)
            positions = positions[component].T  # [T, H // 2]
        else:
            positions = positions[:, None]
        freqs = positions.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
        emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, H]
        if scale == 1.0:
            return cls(jnp.cos(emb), jnp.sin(emb))
        return cls(jnp.cos(emb) * scale, jnp.sin(emb) * scale)


def apply_rope(x: jax.Array, rope: Rope) -> jax.Array:
    """Rotary embedding in the "rotate half" layout of Hugging Face Llama. x: [T, heads, H];
    with partial RoPE (`rope` narrower than H) only the first channels turn."""
    cos, sin = rope.cos[:, None, :].astype(x.dtype), rope.sin[:, None, :].astype(x.dtype)
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :dim], rope), x[..., dim:]], axis=-1)
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def linear(x: jax.Array, w: jax.Array | QArray | SplitRows) -> jax.Array:
    """x [T, I] times a weight [*in, *out] whose leading axes make up I: [T, *out], as one 2-D
    matmul over a free reshape of the weight. A quantized weight (output-major [O, I], see
    jaxllm.quantization) goes through `qmatmul` and comes out the same way.

    Written as an einsum over several axes (e.g. "TNH,NHD->TD"), XLA on CPU may transpose the
    weight every step rather than the activation. The input-major layout itself was measured
    against torch's output-major one on the demo model's 30 layers (2-core AMD EPYC, weights
    streamed from DRAM): equal at T = 1 (about 24 ms), 25% faster at T = 8."""
    if isinstance(w, QUANTIZED):
        return _shaped(x, qmatmul(x, w), w)
    num_in = x.shape[-1]
    out = matmul(x, w.reshape(num_in, -1)).astype(x.dtype)
    return out.reshape(*x.shape[:-1], *w.shape[_num_in_axes(w.shape, num_in) :])


def linears(x: jax.Array, ws: list[jax.Array | QArray]) -> list[jax.Array]:
    """[linear(x, w) for w in ws], the quantized ones through `qmatmuls` (on the CPU, one
    kernel call for those that share a format: a layer's q, k and v, its gate and up)."""
    quantized = [i for i, w in enumerate(ws) if isinstance(w, QArray)]
    if len(quantized) < 2:
        return [linear(x, w) for w in ws]
    out = [None if isinstance(w, QArray) else linear(x, w) for w in ws]
    products = qmatmuls(x, [ws[i] for i in quantized])
    for i, y in zip(quantized, products, strict=True):
        out[i] = _shaped(x, y, ws[i])
    return out


def _shaped(x: jax.Array, y: jax.Array, w: QArray) -> jax.Array:
    """A quantized matmul's f32[T, O] as `linear` returns it: in x's dtype, w's output axes."""
    return y.astype(x.dtype).reshape(*x.shape[:-1], *w.out_shape)


def matmul(x: jax.Array, w: jax.Array, *, w_transposed: bool = False) -> jax.Array:
    """x [T, I] @ w [I, O] (or w [O, I] with `w_transposed`), in float32.

    Products always accumulate in float32 (`preferred_element_type`): with bfloat16 operands,
    XLA's CPU backend otherwise takes a path that is 7x slower than float32 at any T (43 ms
    against 6 ms for the demo model's 30 gate/up weights at T = 4, 2-core AMD EPYC with
    AVX512-BF16), and accelerators accumulate in float32 anyway. On the CPU a single bfloat16
    row is padded to two: XLA's CPU matrix-vector path for bfloat16 is as slow as the above,
    while two rows take its fast matrix path (5 ms)."""
    contract = ((x.ndim - 1,), (1 if w_transposed else 0,))
    rows = x.shape[0]
    # Only on the CPU: XLA:TPU streams a one-row product's weight once, and by its cost model
    # a two-row one five times.
    cpu = pallas_kernels.current_platform() == "cpu"
    pad = cpu and w.dtype == jnp.bfloat16 and rows == 1 and x.ndim == 2
    if pad:
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    out = jax.lax.dot_general(
        x.astype(w.dtype), w, (contract, ((), ())), preferred_element_type=jnp.float32
    )
    return out[:rows] if pad else out


def _num_in_axes(shape: tuple[int, ...], num_in: int) -> int:
    """How many leading axes of a weight make up its input width."""
    size = 1
    for i, d in enumerate(shape, start=1):
        size *= d
        if size == num_in:
            return i
    raise ValueError(f"weight {shape} has no leading axes of total size {num_in}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache (all arrays padded to buckets), per
    layer group (`jaxllm.worker.kv_groups`: G = 1 but for a hybrid sliding-window model)."""

    slot_mapping: jax.Array  # i32[G, T]     cache slot of each token; >= num_slots: padding
    seq_lens: jax.Array  # i32[R]        tokens in the cache per request after this step
    block_tables: jax.Array  # i32[G, R, P]  page ids per request
    cu_q_lens: jax.Array  # i32[R + 1]    start of each request's tokens in the flat batch
    num_seqs: jax.Array  # i32[1]        requests that are real; the rest is padding
    # i32[T]: the last key position each token sees past itself (its image's last token, in
    # a model whose image tokens attend to each other: Gemma 3), -1 for causal; None: all
    # causal (see `pallas_kernels.ragged_paged_attention`)
    attend_to: jax.Array | None = None
    # Static: per model layer, (its group, its slot in the cache's leading axis) per part of
    # its KV (`KVCacheGroups.layer_slots`); None: one group whose slot i is layer i.
    layer_slots: tuple[tuple[tuple[int, int], ...], ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )

    def where(self, layer: int) -> tuple[tuple[int, int], ...]:
        """(group, cache slot) of each part of model layer `layer`'s KV."""
        return ((0, layer),) if self.layer_slots is None else self.layer_slots[layer]


class Attention(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        *,
        dtype,
        mesh=None,
        rngs: nnx.Rngs | None,
    ):
        d, n = config.hidden_size, config.num_heads
        k, h = config.layer_num_kv_heads(layer), config.layer_head_dim(layer)
        # Gemma 4: a layer that shares an earlier layer's keys and values has no k and v of
        # its own; its full-attention layers take their values from the k projection.
        self.kv_source = config.layer_kv_source(layer)
        own_kv = self.kv_source == layer
        self.k_is_v = config.attention_k_eq_v and config.layer_kind(layer) == FULL_ATTENTION
        # Matrices, heads-major on their head side (column h * H + i is head h's i): a 3-D
        # [D, N, H] weight reshaped to 2-D inside the step made XLA:TPU relayout (and widen)
        # it at every step, 5x its bytes. Splitting N * H over devices keeps whole heads.
        # With an output gate, each head's columns are its query's H and then its gate's H
        # (as Qwen3-Next's checkpoints have them).
        self.gated = config.attention_output_gate
        q_width = n * h * (2 if self.gated else 1)
        self.q_proj = param(rngs, (d, q_width), ("embed", "q_heads"), dtype)
        self.k_proj = param(rngs, (d, k * h), ("embed", "kv_heads"), dtype) if own_kv else None
        own_v = own_kv and not self.k_is_v
        self.v_proj = param(rngs, (d, k * h), ("embed", "kv_heads"), dtype) if own_v else None
        self.o_proj = param(rngs, (n * h, d), ("q_heads", "embed"), dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        if config.attention_bias:
            self.q_bias = param(rngs, (n * h,), ("q_heads",), dtype)
            self.k_bias = param(rngs, (k * h,), ("kv_heads",), dtype)
            self.v_bias = param(rngs, (k * h,), ("kv_heads",), dtype)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = param(rngs, (d,), ("embed",), dtype) if config.attention_out_bias else None
        if config.qk_norm:
            kw = dict(
                offset=config.norm_offset,
                float_scale=config.norm_float_scale,
                axis="head_dim",
                dtype=dtype,
            )
            self.q_norm = RMSNorm(h, config.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, **kw) if own_kv else None
        else:
            self.q_norm = self.k_norm = None
        self.v_norm_eps = config.rms_norm_eps if config.v_norm else None
        self.kv_layout = KVLayout.of(config, self.kv_source)
        self.sinks = param(rngs, (n,), ("q_heads",), dtype) if config.attention_sinks else None
        scalar = config.query_pre_attn_scalar
        self.sm_scale = (h if scalar is None else scalar) ** -0.5
        self.soft_cap = config.attn_logit_softcapping
        # Static per layer: the layers are unrolled (see decoder.py), so each layer's kernel
        # call is its own; the kernels take it as data either way.
        self.sliding_window = config.layer_window(layer)
        self.attention_chunk = config.layer_chunk(layer)
        # Llama 4: RoPE layers normalise q and k after it (no weight); the others have no
        # RoPE and scale their queries by position (`q_scale`).
        self.use_rope = config.layer_uses_rope(layer)
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm and self.use_rope else None
        self.temperature = config.attn_temperature_tuning and not self.use_rope
        self.mesh = mesh  # static: tensor parallelism runs the cache ops per device

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        rope: Rope,  # of this step's positions
        kv_cache: KVCache,  # [slots, num_pages, K, page_size, 2H]
        layer: int,  # this layer's index in the model (`meta.where` maps it into the cache)
        meta: AttentionMetadata,
        lora=None,  # this layer's adapters (`jaxllm.models.lora.LayerLoRA`), or None
        q_scale: jax.Array | None = None,  # f32[T]: the queries' temperature (Llama 4)
    ) -> tuple[jax.Array, jax.Array]:
        projections = [w for w in (self.q_proj, self.k_proj, self.v_proj) if w is not None]
        q, *kv = linears(x, [w.get_value() for w in projections])
        k, v = (None, None) if not kv else (kv[0], kv[-1])  # K = V: the k projection's
        if lora is not None:
            q = lora.add("q_proj", x, q)
            if k is not None:
                k = lora.add("k_proj", x, k)
                v = k if self.k_is_v else lora.add("v_proj", x, v)
        if self.q_bias is not None:
            q = q + self.q_bias.get_value()
            k = k + self.k_bias.get_value()
            v = v + self.v_bias.get_value()
        num_tokens, h = x.shape[0], self.head_dim
        gate = None
        if self.gated:
            q, gate = jnp.split(q.reshape(num_tokens, self.num_heads, 2 * h), 2, axis=-1)
        q = q.reshape(num_tokens, self.num_heads, h)  # [T, N, H]
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.use_rope:
            q = apply_rope(q, rope)
        if self.l2_eps is not None:
            q = l2_norm(q, self.l2_eps)
        if k is not None:
            k = k.reshape(num_tokens, self.num_kv_heads, h)  # [T, K, H]
            v = v.reshape(num_tokens, self.num_kv_heads, h)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm_eps is not None:
                v = l2_norm(v, self.v_norm_eps)
            if self.use_rope:
                k = apply_rope(k, rope)
            if self.l2_eps is not None:
                k = l2_norm(k, self.l2_eps)
        if self.temperature:
            q = (q * q_scale[:, None, None]).astype(q.dtype)
        out, kv_cache = self._paged_attention(q, k, v, kv_cache, layer, meta)
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.reshape(out.shape).astype(jnp.float32)).astype(
                out.dtype
            )
        projected = linear(out, self.o_proj.get_value())
        out = projected if lora is None else lora.add("o_proj", out, projected)
        if self.o_bias is not None:
            out = out + self.o_bias.get_value()
        return out, kv_cache

    def _paged_attention(self, q, k, v, kv_cache, layer, meta: AttentionMetadata):
        """Writes the new K/V into the cache (unless the layer shares another's) and attends;
        with a mesh, per device on its own heads (q, k, v and the cache are split on heads,
        the metadata is replicated). A layer packed into the cache (`kv_layout`) attends once
        per part, on queries and keys widened to the cache's rows."""
        layout = self.kv_layout
        parts = meta.where(self.kv_source)  # static: (group, slot) per part
        sinks = None if self.sinks is None else self.sinks.get_value().astype(jnp.float32)
        write = k is not None
        if layout.plain:
            qs, ks, vs, sink_parts = [q], [k], [v], [sinks]
        else:
            qs = layout.pack_q(q)
            ks, vs = (layout.pack_kv(k), layout.pack_kv(v)) if write else (None, None)
            sink_parts = None if sinks is None else layout.pack_heads(sinks)
        dtype = q.dtype
        args = dict(
            q=qs,
            kv=list(zip(ks, vs, strict=True)) if write else None,
            sinks=None if sinks is None else sink_parts,
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables,
            seq_lens=meta.seq_lens,
            cu_q_lens=meta.cu_q_lens,
            num_seqs=meta.num_seqs,
            attend_to=meta.attend_to,
        )

        def run(kv_cache, args):
            # Every part's writes before any part's reads: a read of the cache between two
            # writes made XLA copy it for the second.
            for i, (group, slot) in enumerate(parts if args["kv"] is not None else ()):
                k, v = args["kv"][i]
                kv_cache = pallas_kernels.write_kv(
                    kv_cache, slot, k, v, args["slot_mapping"][group]
                )
            outs = []
            for i, (group, slot) in enumerate(parts):
                qi = args["q"][i]
                out = pallas_kernels.ragged_paged_attention(
                    # A float cache may be wider than the model (see kv_sizing.py); an 8-bit
                    # one is widened to q's dtype by the kernel.
                    qi if kv_cache.quantized else qi.astype(kv_cache.dtype),
                    kv_cache,
                    slot,
                    args["seq_lens"],
                    args["block_tables"][group],
                    args["cu_q_lens"],
                    args["num_seqs"],
                    sm_scale=self.sm_scale,
                    sliding_window=self.sliding_window,
                    soft_cap=self.soft_cap,
                    attend_to=args["attend_to"],
                    sinks=None if args["sinks"] is None else args["sinks"][i],
                    attention_chunk=self.attention_chunk,
                    backend=kernel_choices().attention_backend,
                )
                outs.append(out.astype(dtype))
            return outs, kv_cache

        # One call (one shard_map with a mesh) for all of a layer's parts.
        if self.mesh is None:
            outs, kv_cache = run(kv_cache, args)
        else:
            heads = P(None, "model", None)
            specs = {name: P() for name in args}
            specs |= dict(q=heads, kv=heads if write else None, sinks=P("model"))
            cache = kv_cache_specs(kv_cache.quantized)
            outs, kv_cache = jax.shard_map(
                run,
                mesh=self.mesh,
                in_specs=(cache, specs),
                out_specs=(heads, cache),
                check_vma=False,
            )(kv_cache, args)
        out = outs[0] if layout.plain else layout.unpack_out(outs)
        return out, kv_cache


class MLP(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, dtype, rngs: nnx.Rngs | None, width: int | None = None
    ):
        """`width`: the MLP's F when not the config's (a mixture of experts' shared expert)."""
        d, f = config.hidden_size, width or config.intermediate_size
        self.gate_proj = param(rngs, (d, f), ("embed", "mlp"), dtype)
        self.up_proj = param(rngs, (d, f), ("embed", "mlp"), dtype)
        self.down_proj = param(rngs, (f, d), ("mlp", "embed"), dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        gate, up = linears(x, [self.gate_proj.get_value(), self.up_proj.get_value()])
        if lora is not None:
            gate, up = lora.add("gate_proj", x, gate), lora.add("up_proj", x, up)
        h = self.act(gate) * up
        out = linear(h, self.down_proj.get_value())
        return out if lora is None else lora.add("down_proj", h, out)
