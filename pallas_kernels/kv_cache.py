"""The paged KV cache layout, shared by every attention backend.

One layer's cache is one array `[num_pages, page_size, 2 * K, H]`: K and V interleaved on the
head axis (index 2k is key head k, 2k + 1 is value head k). Interleaving keeps a kv head's keys
and values together, so sharding axis 2 over devices gives each device whole heads, and one
page DMA brings both K and V of a page.

A token's slot is `page * page_size + offset`. Writes go through `write_kv`, a scatter into
the donated cache, so no step copies the whole cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def get_kv_cache_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The shape of one layer's paged KV cache: `[num_pages, page_size, 2 * K, H]`."""
    for name, value in (
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (num_pages, page_size, 2 * num_kv_heads, head_dim)


def write_kv(
    kv_cache: jax.Array,  # [num_pages, page_size, 2K, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= num_slots means padding
) -> jax.Array:
    """Writes the new tokens' keys and values into their slots.

    Slots at or past `num_pages * page_size` are dropped: the runner marks padding tokens with
    such a slot. (Negative slots would wrap around, so padding must never use -1.)
    """
    num_pages, page_size, kh2, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (kh2 // 2, head_dim):
        raise ValueError(
            f"k and v must be [T, {kh2 // 2}, {head_dim}] for this cache; got k {k.shape}, "
            f"v {v.shape}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {slot_mapping.shape}")
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, kh2, head_dim).astype(kv_cache.dtype)
    flat = kv_cache.reshape(num_pages * page_size, kh2, head_dim)
    flat = flat.at[slot_mapping].set(kv, mode="drop")
    return flat.reshape(kv_cache.shape)
