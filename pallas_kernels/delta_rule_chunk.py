"""What the forms of the gated delta rule share (`gated_delta_rule.py`,
`gated_delta_rule_tpu.py`): one chunk in the WY form, where each token of a ragged batch sits,
and the padding of operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # exp of it is 0; not -inf, which Triton's exp of a difference could turn to NaN


def chunk_algebra(s, q, k, v, g, b, *, dot, invert):
    """One chunk of one head: s [Dk, Dv] the state entering it; q, k [C, Dk]; v [C, Dv]; g, b
    [C, 1] columns (rows past the chunk's tokens all zero: no decay, no write). (o [C, Dv], the
    state after it.) `dot(x, y, trans_a, trans_b)` and `invert(a)` = (I + a)^-1 for a strictly
    lower-triangular a are what the XLA and the kernel forms do differently. Two-dimensional
    throughout (columns [C, 1], rows [1, C]): Mosaic has no cheap way between a vector's lanes
    and its sublanes."""
    c = g.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    # The cumulative log-decay as a row, then the same numbers as a column (the diagonal: a sum
    # of one entry and zeros is exact), so exp(G_i - G_i) is exactly 1.
    g_row = jnp.sum(jnp.where(i <= j, g, 0.0), axis=0, keepdims=True)  # [1, C]
    big_g = jnp.sum(jnp.where(i == j, g_row, 0.0), axis=1, keepdims=True)  # [C, 1]
    decay = jnp.exp(jnp.where(j <= i, big_g - g_row, _NEG))
    a = jnp.where(j < i, b * dot(k, k, False, True) * decay, 0.0)
    scale = jnp.exp(big_g)
    inverse = invert(a)  # T
    w_k = dot(inverse, k * (b * scale), False, False)  # [C, Dk]
    w_v = dot(inverse, v * b, False, False)  # [C, Dv]
    u = w_v - dot(w_k, s, False, False)  # [C, Dv]
    scores = jnp.where(j <= i, dot(q, k, False, True) * decay, 0.0)
    o = scale * dot(q, s, False, False) + dot(scores, u, False, False)
    # The chunk's whole log-decay as the cumulative sum's last entry, not a sum of its own: the
    # last token's exp(total - G) must be exactly 1 (two roundings of a long sum differ).
    last = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1) == c - 1
    total = jnp.sum(jnp.where(last, g_row, 0.0), axis=1, keepdims=True)  # [1, 1]
    s = jnp.exp(total) * s + dot(k * jnp.exp(total - big_g), u, True, False)
    return o, s


def token_rows(starts, q_lens, num_tokens: int):
    """Per token of a ragged batch: (its request, its index in the request's tokens, whether it
    is past the request's first: the tokens the chunked forms' loops take)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    ends = starts + q_lens
    request = jnp.minimum(
        jnp.searchsorted(ends, t, side="right", method="compare_all"), starts.shape[0] - 1
    )
    index = t - starts[request]
    return request, index, (index > 0) & (index < q_lens[request])


def pad_to(x, *dims):
    """x padded with zeros at the end of each axis to `dims`."""
    return jnp.pad(x, [(0, d - n) for d, n in zip(dims, x.shape, strict=True)])
