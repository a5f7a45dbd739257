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

An 8-bit cache (`int8`, or `fp8` = float8 e4m3) is a `KVCache`: the 8-bit data in the same
layout (fp8 kept as its bytes, see `_STORAGE`) plus one float32 scale per (layer, page, K or V
head, token), `scales[L, num_pages, 2K, page_size]`, so that `value = data * scale`. The scale
is the token's absolute maximum over the head divided by the format's largest value (127 or
448), set when the token is written: a symmetric per-token, per-head quantization that needs
no calibration and is exact for the token's largest element. Page-major like the data, so a
page's data and scales move together; heads before tokens, so a TPU kernel loads one head's
scales of a page as a lane vector. A page costs (H + 4) bytes per token and head instead of 4H
(float32) or 2H (bfloat16): 3.8x and 1.9x the pages at head size 64, 3.9x and 1.9x at 128.
Every backend reads the 8-bit data and scales in place and widens only what it computes with.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The cache formats `kv_cache_dtype` names, beyond the model's float dtypes.
QUANTIZED_KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# The array dtype each format is stored as. float8 as its bytes: XLA's CPU backend has no
# float8 scatter and widens the whole operand to float16 and back (a copy of the cache, every
# step), and a bitcast of the scattered bytes back to float8 is a copy there too. Readers
# bitcast what they gathered (`widen_kv`), which costs nothing on TPU and GPU.
_STORAGE = {
    jnp.dtype(jnp.int8): jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
}
_FORMAT = {v: k for k, v in _STORAGE.items()}  # storage dtype -> format


def _format(dtype) -> jnp.dtype:
    """The format a dtype names: itself, or the 8-bit format stored as it."""
    return _FORMAT.get(jnp.dtype(dtype), jnp.dtype(dtype))


class KVCache(NamedTuple):
    """The paged cache of all layers; `scales` is None for a float cache (see the module doc)."""

    data: jax.Array  # [L, num_pages, page_size, 2K, H]
    scales: jax.Array | None = None  # f32[L, num_pages, 2K, page_size], 8-bit data only

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The format: the float dtype, int8, or float8_e4m3fn (stored as uint8)."""
        return _format(self.data.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @property
    def quantized(self) -> bool:
        return self.scales is not None


def is_quantized_dtype(dtype) -> bool:
    """Whether `dtype` is an 8-bit format, or the array dtype one is stored as."""
    return _format(dtype) in _QMAX


def widen_kv(x: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Cache values as stored (float, int8, or float8 bytes) -> `dtype`, unscaled."""
    if x.dtype == jnp.uint8:
        x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    return x.astype(dtype)


def as_kv_cache(kv_cache: jax.Array | KVCache) -> KVCache:
    """A bare array is a float cache; a `KVCache` is checked for data and scales that agree."""
    if not isinstance(kv_cache, KVCache):
        kv_cache = KVCache(kv_cache)
    data, scales = kv_cache
    if is_quantized_dtype(data.dtype) != (scales is not None):
        raise ValueError(
            f"a {data.dtype} KV cache needs {'float32 scales' if scales is None else 'no scales'}"
        )
    if scales is not None:
        num_layers, num_pages, page_size, kh2, _ = data.shape
        want = (num_layers, num_pages, kh2, page_size)
        if scales.shape != want or scales.dtype != jnp.float32:
            raise ValueError(
                f"kv cache scales must be f32{list(want)}, got {scales.dtype}{list(scales.shape)}"
            )
    return kv_cache


def zeros_kv_cache(shape: tuple[int, ...], dtype) -> KVCache:
    """An empty cache of `shape` (`get_kv_cache_shape`) and `dtype` (float or 8-bit)."""
    if not is_quantized_dtype(dtype):
        return KVCache(jnp.zeros(shape, dtype))
    data = jnp.zeros(shape, _STORAGE[_format(dtype)])
    num_layers, num_pages, page_size, kh2, _ = shape
    return KVCache(data, jnp.zeros((num_layers, num_pages, kh2, page_size), jnp.float32))


def kv_bytes_per_token_head(head_dim: int, dtype) -> int:
    """Bytes a K or V head of one token takes in a cache of `dtype`, its scale included."""
    return head_dim * jnp.dtype(dtype).itemsize + (4 if is_quantized_dtype(dtype) else 0)


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """[..., H] floats -> (8-bit [..., H] as stored, f32 scales [...]): per-vector
    symmetric, in format `dtype` (int8 or float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    qmax = _QMAX[dtype]
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    y = x / scale[..., None]
    if dtype == jnp.int8:
        y = jnp.round(y)
    y = jnp.clip(y, -qmax, qmax).astype(dtype)
    return jax.lax.bitcast_convert_type(y, _STORAGE[dtype]), scale


def read_kv(kv_cache: KVCache, layer, pages: jax.Array, offsets: jax.Array | None = None):
    """float32 K/V of `pages` (any index shape) of one layer: [..., page_size, 2K, H], or with
    `offsets` (same shape as `pages`) one token of each: [..., 2K, H]. For the jnp backends;
    an 8-bit cache is dequantized here, after the gather, so only what is read is widened."""
    data, scales = kv_cache
    if offsets is None:
        kv = widen_kv(data[layer, pages])
        if scales is not None:
            kv = kv * jnp.swapaxes(scales[layer, pages], -1, -2)[..., None]
        return kv
    kv = widen_kv(data[layer, pages, offsets])
    if scales is not None:
        kv = kv * scales[layer, pages, :, offsets][..., None]
    return kv


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
    kv_cache: jax.Array | KVCache,  # [L, num_pages, page_size, 2K, H]
    layer: jax.Array | int,  # i32[]  the layer to write
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= num_slots means padding
) -> jax.Array | KVCache:
    """Writes the new tokens' keys and values into their slots of one layer; returns the cache
    in the form it was given (an array, or a `KVCache`, whose 8-bit data is quantized here).

    Slots at or past `num_pages * page_size` are dropped: the runner marks padding tokens with
    such a slot. (Negative slots would wrap around, so padding must never use -1.)
    """
    cache = as_kv_cache(kv_cache)
    num_layers, num_pages, page_size, kh2, head_dim = cache.shape
    num_tokens = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (kh2 // 2, head_dim):
        raise ValueError(
            f"k and v must be [T, {kh2 // 2}, {head_dim}] for this cache; got k {k.shape}, "
            f"v {v.shape}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {slot_mapping.shape}")
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, kh2, head_dim)
    if cache.quantized:
        kv, scales = quantize_kv(kv, cache.dtype)  # [T, 2K, H], [T, 2K]
    else:
        kv, scales = kv.astype(cache.dtype), None
    if num_tokens == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice that reads the old row back
        # (to keep it if the slot is out of range), and that second use of the cache makes it
        # copy the whole cache, every step (measured: 1.1 GB of temporaries and seconds per
        # decode step for the demo model). A second, dropped row keeps it a scatter.
        kv = jnp.concatenate([kv, kv])
        scales = None if scales is None else jnp.concatenate([scales, scales])
        slot_mapping = jnp.concatenate(
            [slot_mapping, jnp.full((1,), num_pages * page_size, slot_mapping.dtype)]
        )
    flat = cache.data.reshape(num_layers, num_pages * page_size, kh2, head_dim)
    # lax.scatter rather than `.at[layer, slots].set`: the same op, a tenth of the tracing
    # (the model traces it once per layer for every compiled shape at startup).
    layers = jnp.broadcast_to(jnp.asarray(layer, slot_mapping.dtype), slot_mapping.shape)
    data = jax.lax.scatter(
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
    data = data.reshape(cache.shape)
    if not cache.quantized:
        return data if not isinstance(kv_cache, KVCache) else KVCache(data)
    # The scales of slot s sit at [layer, s // page_size, :, s % page_size]; a padding slot's
    # page is past the last, so it is dropped like its data.
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    new_scales = jax.lax.scatter(
        cache.scales,
        jnp.stack([layers, page, offset], axis=-1),  # [T, 3]: (layer, page, offset)
        scales,
        jax.lax.ScatterDimensionNumbers(
            update_window_dims=(1,),
            inserted_window_dims=(0, 1, 3),
            scatter_dims_to_operand_dims=(0, 1, 3),
        ),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )
    return KVCache(data, new_scales)
