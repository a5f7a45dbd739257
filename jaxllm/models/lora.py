"""Batched LoRA inside the step: every token adds its own adapter's `x A B` to a projection,
from adapter slots stacked on the device (the Punica / S-LoRA idea, as two plain matmuls).

A target's slots are, per layer, A [in, S, R] and B [S, R, out] (S slots of rank R, the ranks
padded to the largest with zeros; B carries the adapter's scaling): arrays of their own, as
the layers' weights are (a slice of one [L, ...] array per layer made XLA's CPU backend copy
it at every step, 0.60x the base model's decode at batch 16). For one layer, x [T, in]
times A's [in, S * R] gives every slot's projection of every token; a one-hot of each token's
slot [T, S] keeps its own (a token without an adapter keeps none), and [T, S * R] times B's
[S * R, out] adds the result. The work is 2 T S R (in + out), small beside the base matmul
for the ranks served (S R = 64 against in = 4,096 for an 8B model), and its shapes depend on
the slot count and maximal rank only: loading another adapter changes data, never a program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.models.layers import matmul


def layer_loras(
    weights: dict[str, tuple[list[jax.Array], list[jax.Array]]], token_slots: jax.Array
) -> list[LayerLoRA]:
    """Each layer's adapters for a step: the slots' matrices by target and layer ({target:
    ([A [in, S, R] per layer], [B [S, R, out] per layer])}) and the one-hot of each token's
    slot (`token_slots` i32[T], -1: none), made once for all layers."""
    a_layers, b_layers = next(iter(weights.values()))
    onehot = token_slots[:, None] == jnp.arange(b_layers[0].shape[0], dtype=jnp.int32)
    return [
        LayerLoRA({t: (a[i], b[i]) for t, (a, b) in weights.items()}, onehot)
        for i in range(len(a_layers))
    ]


@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    weights: dict[str, tuple[jax.Array, jax.Array]]  # {target: (A [in, S, R], B [S, R, out])}
    onehot: jax.Array  # bool[T, S]

    def add(self, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (x's projection by `target`, [T, out]) plus each token's adapter's x A B."""
        if target not in self.weights:
            return y
        a, b = self.weights[target]
        num_in, slots, rank = a.shape
        h = matmul(x, a.reshape(num_in, slots * rank)).reshape(-1, slots, rank)
        h = jnp.where(self.onehot[:, :, None], h, 0.0).reshape(-1, slots * rank)
        delta = matmul(h.astype(b.dtype), b.reshape(slots * rank, -1))
        return (y.astype(jnp.float32) + delta).astype(y.dtype)
