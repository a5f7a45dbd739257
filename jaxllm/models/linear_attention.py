"""Gated DeltaNet, the linear-attention layer of the hybrid Qwen models (Qwen3-Next, Qwen3.5):
three of every four layers. In place of keys and values in pages, a layer keeps a fixed-size
state per request (`LinearState`, a field of the model's donated cache):

- the last `conv_kernel - 1` inputs of a causal depthwise convolution over the concatenated
  q, k and v channels, and
- the delta rule's matrix S [value heads, key dim, value dim], updated per token as
      S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q
  with q and k L2-normalised, q scaled by key_dim ** -0.5, beta = sigmoid(b) and the decay
  g = -exp(A_log) * softplus(a + dt_bias) per value head.

A step's tokens are a ragged batch (`AttentionMetadata.cu_q_lens`): a request's tokens are
contiguous, its prefill chunk or its one decode token. Each request's state is read from its
slot (`StepExtras.state_slots`, i32[R], a slot per running request that the runner assigns),
taken as zero when its chunk starts at position 0 (a new or recomputed request: no reset is
needed on admission or preemption), carried through its tokens and written back to the slot.

This is the reference form, in pure JAX: one `lax.scan` over the step's tokens, each token one
rank-1 update of its request's state. Its work is the recurrence's (T x heads x key x value)
and it runs on every backend; the chunked (parallel-within-chunk) form for long prefills is
the faster one on accelerators and is not written yet.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.models.layers import AttentionMetadata, linear, param


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """Every linear layer's state, per slot: `conv` [layers, slots, conv_kernel - 1, channels]
    in the model's dtype (as transformers keeps it), `recurrent` [layers, slots, value heads,
    key dim, value dim] in float32."""

    conv: jax.Array
    recurrent: jax.Array

    @classmethod
    def shapes(cls, config: ModelConfig, num_slots: int, dtype) -> LinearState:
        """The state's `jax.ShapeDtypeStruct`s for `num_slots` requests."""
        la = config.linear_attention
        n = len(config.linear_layers)
        return cls(
            jax.ShapeDtypeStruct((n, num_slots, la.conv_kernel - 1, la.conv_dim), dtype),
            jax.ShapeDtypeStruct(
                (n, num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim),
                jnp.float32,
            ),
        )


def state_bytes_per_slot(config: ModelConfig, dtype) -> int:
    """Bytes of one request's state over all linear layers."""
    shapes = LinearState.shapes(config, 1, dtype)
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where each of a step's tokens sits: its request, its index in the request's chunk, and
    the per-request facts the recurrence needs."""

    request: jax.Array  # i32[T]
    index: jax.Array  # i32[T]: 0 for a request's first token of the step
    valid: jax.Array  # bool[T]: not padding
    starts: jax.Array  # i32[R]: each request's first token in the step
    q_lens: jax.Array  # i32[R]
    fresh: jax.Array  # bool[R]: the chunk starts at position 0 (a zero state)

    @classmethod
    def of(cls, meta: AttentionMetadata, num_tokens: int) -> _Rows:
        cu = meta.cu_q_lens
        num_reqs = cu.shape[0] - 1
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        request = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
        request = jnp.minimum(request, num_reqs - 1)
        q_lens = cu[1:] - cu[:-1]
        return cls(
            request=request,
            index=t - cu[request],
            valid=t < cu[meta.num_seqs[0]],
            starts=cu[:-1],
            q_lens=q_lens,
            fresh=meta.seq_lens == q_lens,
        )


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: ModelConfig, ordinal: int, *, dtype, rngs: nnx.Rngs | None):
        """`ordinal`: this layer's index among the model's linear layers (its row of the
        state)."""
        la = config.linear_attention
        d = config.hidden_size
        self.shape = la
        self.ordinal = ordinal
        key_dim = la.num_key_heads * la.key_head_dim
        # Columns in the order [q, k, v, z] and [b, a], each heads-major (the loader
        # reorders Qwen3-Next's per-key-head interleaving into it).
        if la.fused_projections:
            self.in_proj_qkvz = param(rngs, (d, la.conv_dim + la.value_dim), ("embed", None), dtype)
            self.in_proj_ba = param(rngs, (d, 2 * la.num_value_heads), ("embed", None), dtype)
        else:
            self.in_proj_qkv = param(rngs, (d, la.conv_dim), ("embed", None), dtype)
            self.in_proj_z = param(rngs, (d, la.value_dim), ("embed", None), dtype)
            self.in_proj_b = param(rngs, (d, la.num_value_heads), ("embed", None), dtype)
            self.in_proj_a = param(rngs, (d, la.num_value_heads), ("embed", None), dtype)
        self.conv1d = param(rngs, (la.conv_kernel, la.conv_dim), (None, None), dtype)
        self.dt_bias = nnx.Param(jnp.ones((la.num_value_heads,), dtype), axes=(None,))
        self.A_log = nnx.Param(jnp.zeros((la.num_value_heads,), dtype), axes=(None,))
        self.norm_weight = nnx.Param(jnp.ones((la.value_head_dim,), dtype), axes=(None,))
        self.out_proj = param(rngs, (la.value_dim, d), (None, "embed"), dtype)
        self.eps = config.rms_norm_eps
        self.key_dim = key_dim

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """(mixed q|k|v [T, C], z [T, Hv * Dv], b [T, Hv], a [T, Hv])."""
        la = self.shape
        if la.fused_projections:
            qkvz = linear(x, self.in_proj_qkvz.get_value())
            ba = linear(x, self.in_proj_ba.get_value())
            mixed, z = jnp.split(qkvz, [la.conv_dim], axis=-1)
            b, a = jnp.split(ba, 2, axis=-1)
            return mixed, z, b, a
        return tuple(
            linear(x, w.get_value())
            for w in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        )

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        state: LinearState,
        meta: AttentionMetadata,
        slots: jax.Array,  # i32[R]: each request's state slot
    ) -> tuple[jax.Array, LinearState]:
        la = self.shape
        num_tokens = x.shape[0]
        rows = _Rows.of(meta, num_tokens)
        mixed, z, b, a = self._project(x)
        conv_state = state.conv[self.ordinal]  # [S, K - 1, C]
        mixed, new_conv = _causal_conv(mixed, conv_state, self.conv1d.get_value(), rows, slots)
        q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        r = la.num_value_heads // la.num_key_heads
        q = jnp.repeat(q.reshape(num_tokens, la.num_key_heads, la.key_head_dim), r, axis=1)
        k = jnp.repeat(k.reshape(num_tokens, la.num_key_heads, la.key_head_dim), r, axis=1)
        v = v.reshape(num_tokens, la.num_value_heads, la.value_head_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype)  # rounded as HF does
        decay = -jnp.exp(self.A_log.get_value().astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias.get_value().astype(jnp.float32)
        )
        initial = state.recurrent[self.ordinal][slots]  # [R, Hv, Dk, Dv]
        out, final = gated_delta_rule(q, k, v, decay, beta, initial, rows)
        out = out.astype(x.dtype)
        # The gated RMSNorm per value head: normalise, scale, then times silu(z) in float32.
        z = z.reshape(num_tokens, la.num_value_heads, la.value_head_dim)
        of = out.astype(jnp.float32)
        of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + self.eps)
        normed = self.norm_weight.get_value() * of.astype(x.dtype)
        gated = (normed * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
        out = linear(gated.reshape(num_tokens, -1), self.out_proj.get_value())
        # Padding rows write nowhere (their slot index is out of range and dropped).
        num_slots = conv_state.shape[0]
        live = jnp.arange(slots.shape[0]) < meta.num_seqs[0]
        where = jnp.where(live, slots, num_slots)
        state = LinearState(
            state.conv.at[self.ordinal, where].set(new_conv.astype(state.conv.dtype), mode="drop"),
            state.recurrent.at[self.ordinal, where].set(final, mode="drop"),
        )
        return out, state


def _causal_conv(mixed, conv_state, weight, rows: _Rows, slots):
    """The depthwise causal convolution of each request's chunk, continued from its state,
    with silu; and each request's new state (its last K - 1 inputs). mixed [T, C], conv_state
    [S, K - 1, C], weight [K, C] (tap K - 1 is the current token)."""
    kernel = weight.shape[0]
    num_tokens = mixed.shape[0]
    prior = conv_state[slots]  # [R, K - 1, C]
    prior = jnp.where(rows.fresh[:, None, None], 0, prior).astype(mixed.dtype)
    t = jnp.arange(num_tokens)
    acc = jnp.zeros(mixed.shape, jnp.float32)
    for back in range(kernel):  # the input `back` tokens before each token
        own = rows.index >= back
        from_batch = mixed[jnp.maximum(t - back, 0)]
        held = prior[rows.request, jnp.clip(kernel - 1 + rows.index - back, 0, kernel - 2)]
        source = jnp.where(own[:, None], from_batch, held)
        acc = acc + source.astype(jnp.float32) * weight[kernel - 1 - back].astype(jnp.float32)
    out = jax.nn.silu(acc.astype(mixed.dtype).astype(jnp.float32)).astype(mixed.dtype)
    # The new state: the chunk's last K - 1 inputs, reaching into the old state when the
    # chunk is shorter than that.
    j = jnp.arange(kernel - 1)
    pos = rows.q_lens[:, None] - (kernel - 1) + j[None, :]  # [R, K - 1], in the chunk
    from_batch = mixed[jnp.clip(rows.starts[:, None] + pos, 0, num_tokens - 1)]
    held = jnp.take_along_axis(prior, jnp.clip(kernel - 1 + pos, 0, kernel - 2)[:, :, None], axis=1)
    new_state = jnp.where((pos >= 0)[:, :, None], from_batch, held)
    return out, new_state


def gated_delta_rule(q, k, v, decay, beta, initial, rows: _Rows):
    """The gated delta rule over a ragged batch, token by token (the reference form).

    q, k [T, Hv, Dk]; v [T, Hv, Dv]; decay, beta f32[T, Hv]; initial f32[R, Hv, Dk, Dv] (each
    request's state before the step; a fresh request's is taken as zero). Returns (o f32[T,
    Hv, Dv], each request's state after its last token f32[R, Hv, Dk, Dv]; a request with no
    token keeps its initial state)."""
    q = _l2norm(q.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    k = _l2norm(k.astype(jnp.float32))
    v = v.astype(jnp.float32)
    initial = jnp.where(rows.fresh[:, None, None, None], 0.0, initial)
    last = rows.valid & (rows.index == rows.q_lens[rows.request] - 1)

    def step(carry, xs):
        s, final = carry
        q_t, k_t, v_t, g_t, b_t, req, first, valid, is_last = xs
        s = jnp.where(first, initial[req], s)
        s = s * jnp.exp(g_t)[:, None, None]
        memory = jnp.einsum("hkv,hk->hv", s, k_t)
        delta = (v_t - memory) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", s, q_t)
        final = final.at[req].set(jnp.where(is_last, s, final[req]))
        return (s, final), jnp.where(valid, o_t, 0.0)

    first = rows.index == 0
    xs = (q, k, v, decay, beta, rows.request, first, rows.valid, last)
    (_, final), out = jax.lax.scan(step, (initial[0], initial), xs)
    return out, final


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
