"""The paged KV cache layout, shared by every attention backend.

The cache of all layers is one array `[L, num_pages, page_size, 2 * K, H]`: K and V
interleaved on the head axis (index 2k is key head k, 2k + 1 is value head k). Interleaving
keeps a kv head's keys and values together, so sharding axis 3 over devices gives each device
whole heads, and one page DMA brings both K and V of a page.

Why one array with a layer axis rather than one array per layer: the model runs its layers
under `lax.scan` (traced and compiled once, not 30 times: startup compiles every bucket), and
the cache rides in the scan's carry. Every op then takes the layer index and reads or writes
`cache[layer, ...]` in place; slicing a layer out (`cache[layer]`) would copy it.

A token's slot is `page * page_size + offset`. Writes go through `write_kv`, a scatter into
the donated cache, so no step copies the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def get_kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """The shape of the paged KV cache: `[L, num_pages, page_size, 2 * K, H]`."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)


def write_kv(
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
    layer: jax.Array | int,  # i32[]  the layer to write
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= num_slots means padding
) -> jax.Array:
    """Writes the new tokens' keys and values into their slots of one layer.

    Slots at or past `num_pages * page_size` are dropped: the runner marks padding tokens with
    such a slot. (Negative slots would wrap around, so padding must never use -1.)
    """
    num_layers, num_pages, page_size, kh2, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (kh2 // 2, head_dim):
        raise ValueError(
            f"k and v must be [T, {kh2 // 2}, {head_dim}] for this cache; got k {k.shape}, "
            f"v {v.shape}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {slot_mapping.shape}")
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, kh2, head_dim).astype(kv_cache.dtype)
    if num_tokens == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice that reads the old row back
        # (to keep it if the slot is out of range), and that second use of the cache makes it
        # copy the whole cache, every step (measured: 1.1 GB of temporaries and seconds per
        # decode step for the demo model). A second, dropped row keeps it a scatter.
        kv = jnp.concatenate([kv, kv])
        slot_mapping = jnp.concatenate(
            [slot_mapping, jnp.full((1,), num_pages * page_size, slot_mapping.dtype)]
        )
    flat = kv_cache.reshape(num_layers, num_pages * page_size, kh2, head_dim)
    # lax.scatter rather than `.at[layer, slots].set`: the same op, a tenth of the tracing
    # (the model traces it once per layer for every compiled shape at startup).
    layers = jnp.broadcast_to(jnp.asarray(layer, slot_mapping.dtype), slot_mapping.shape)
    flat = jax.lax.scatter(
        flat,
        jnp.stack([layers, slot_mapping], axis=-1),  # [T, 2]: (layer, slot)
        kv,
        jax.lax.ScatterDimensionNumbers(
            update_window_dims=(1, 2),
            inserted_window_dims=(0, 1),
            scatter_dims_to_operand_dims=(0, 1),
        ),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )
    return flat.reshape(kv_cache.shape)
