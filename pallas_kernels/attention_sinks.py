"""Attention sinks (gpt-oss): a learned logit per query head that joins every softmax's
denominator as one more key whose value is zero, so a head can attend to nothing.

Every backend keeps the online softmax's running max `m`, sum `l` and unnormalized output
`acc`, and folds the sink in once at the end, as if it were one more key block: the output
is `alpha * acc / l'`. A row with no keys (padding) has l = 0 and acc = 0, and stays 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fold_sink(m: jax.Array, l: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(l', alpha): the softmax's denominator with the sink's exp(sink) added, and the factor
    that rescales `acc` to the new running max (max(m, sink)); all in float32, shaped alike
    (`m`, `l` and `sink` broadcast together; `alpha` multiplies `acc` after the caller
    broadcasts it over the head dim)."""
    top = jnp.maximum(m, sink)
    alpha = jnp.exp(m - top)
    return alpha * l + jnp.exp(sink - top), alpha


def check_sinks(sinks: jax.Array | None, num_heads: int) -> jax.Array | None:
    """`sinks` as f32[N], or a ValueError naming it."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(
            f"sinks must be a float array [{num_heads}] (one logit per query head), got "
            f"{sinks.dtype}{list(sinks.shape)}"
        )
    return sinks.astype(jnp.float32)
