"""Random weights in the model's shapes (vLLM's `--load-format dummy`): the engine runs from a
`config.json` alone, for benchmarks of speed and memory on a machine that has no checkpoint
(an 8B or 70B model measured on a rented GPU or TPU without copying its weights there).

The tokens such a model produces mean nothing. Each parameter is made on its devices, already
sharded, by a jitted random draw: nothing whole goes through the host, so a model that fits
the devices' memory loads in seconds. Matrices draw from N(0, 0.02²) (the usual
`initializer_range`, which keeps the activations finite through many layers); norm scales are
ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.loaders.weights import param_dtype

LOAD_FORMATS = ("auto", "dummy")
INIT_STD = 0.02


@functools.cache
def _draw(shape: tuple[int, ...], dtype: jnp.dtype, norm: bool, sharding):
    def draw(key):
        if norm:
            return jnp.ones(shape, dtype)
        return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


def dummy_state(
    abstract_state: nnx.State,
    dtype: jnp.dtype,
    shardings: dict[tuple, jax.sharding.Sharding] | None = None,
    seed: int = 0,
) -> nnx.State:
    """Fills an abstract model state with random weights of `dtype`, each parameter placed
    with its sharding from `shardings` ({path: sharding}, as `build_state` takes)."""
    key = jax.random.key(seed)
    filled = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract_state)):
        norm = any("norm" in str(part) for part in path)
        sharding = None if shardings is None else shardings[path]
        value = _draw(tuple(var.shape), param_dtype(var, dtype), norm, sharding)(
            jax.random.fold_in(key, i)
        )
        filled.append((path, var.replace(value)))
    return nnx.from_flat_state(filled)
