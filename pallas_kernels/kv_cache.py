"""The paged KV cache layout, shared by every attention backend.

The cache of all layers is one array `[L, num_pages, K, page_size, 2H]`: for each page and kv
head a `[page_size, 2H]` block whose row t is token t's key (lanes `[0, H)`) followed by its
value (lanes `[H, 2H)`).

Why this layout: a TPU lays out the two minor dimensions of an array in (8, 128) tiles (16 or
32 rows for 16- and 8-bit types, packed), and its kernels want them tile-aligned. The minor
dimensions here are (page_size, 2H): page sizes 8, 16, 32... and 2H = 128, 256, 512 fill whole
tiles for every head count and dtype, and head_dim 64 packs K and V into one 128-lane row
instead of padding each to 128. The layout it replaces, `[L, pages, page_size, 2K, H]`, had the
head count in the tiled dimensions: with 3 kv heads per device XLA copied the whole cache into
the kernel's layout on every call (found by compiling for TPU). The rows of a page stay whole
in one DMA (`[K, page_size, 2H]`, all kv heads of a device), and sharding axis 2 gives each
device whole heads.

Why one array with a layer axis rather than one array per layer: every op takes the layer index
and reads or writes `cache[layer, ...]` in place; the forward program donates the cache and
updates it in place (a program that copies it fails warmup, see `jaxllm.worker.compiler`).

A token's slot is `page * page_size + offset`. Writes go through `write_kv`, a scatter into
the donated cache, so no step copies the cache.

An 8-bit cache (`int8`, or `fp8` = float8 e4m3) is a `KVCache`: the 8-bit data in the same
layout (fp8 kept as its bytes, see `_STORAGE`) plus one float32 scale per (layer, page, kv
head, K or V, token), `scales[L, num_pages, 1, 2K * page_size]` with lane `(2k + j) * page_size
+ t` the scale of head k's key (j = 0) or value (j = 1) at offset t, so that `value = data *
scale`. The scale is the vector's absolute maximum over the head divided by the format's
largest value (127 or 448), set when the token is written: a symmetric per-token, per-head
quantization that needs no calibration and is exact for the token's largest element. A page's
scales are one lane-dense row (a TPU tiles `[2K, page_size]` into 8 x 128 words), and move with
the page. A page costs (2H + 8) bytes per token and kv head instead of 8H (float32) or 4H
(bfloat16). Every backend reads the 8-bit data and scales in place and widens only what it
computes with.

A head is `W = cache_head_dim(H, platform)` wide in the cache: H itself on the CPU; on a TPU,
2W is 2H rounded up to whole 128-lane tiles (head_dim 80 and 96 take 128), since a TPU lays out
a cache whose rows are not whole tiles with its pages minor, and the kernel would copy it into
row-major on every call; on a GPU, W is the power of two Triton's blocks need. Keys and values
are written with zeros in the extra lanes and queries padded with zeros (the results are the
same). A device may still pad a page's rows (the sublanes: e.g. 8 bfloat16 rows), so
`jaxllm.worker.kv_sizing` sizes a TPU pool from the compiled layout's bytes, not from this module's
arithmetic.

A latent attention cache (DeepSeek's MLA, `mla_attention.py`) keeps one row per token, no
key and value, and lays out two tokens to a pair row (`get_kv_cache_shape(latent=True)`), so
that DeepSeek's 576-wide rows fill whole tiles (1,152 lanes = 9 x 128) with no padding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.target import current_platform

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

    data: jax.Array  # [L, num_pages, K, page_size, 2H]
    scales: jax.Array | None = None  # f32[L, num_pages, 1, 2K * page_size], 8-bit data only

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


def scales_shape(
    shape: tuple[int, ...], platform: str | None = None, shards: int = 1
) -> tuple[int, int, int, int]:
    """The scales' shape of an 8-bit cache of data `shape` `[L, num_pages, K, page_size, 2H]`
    on `platform` (default: the one kernels are traced for), split on its kv heads over
    `shards` devices: `[L, num_pages, 1, shards * lanes]`, each device's `lanes` its
    `2 * (K / shards) * page_size` scales. On a TPU the lanes are rounded up to whole 128-lane
    tiles and the pages to a multiple of 8 (a float32 tile's rows): with fewer lanes XLA:TPU
    laid the scales out pages-minor, and with a page count off the 8 it scattered into them in
    another layout; either way every step copied them (1.7 GB for an int8 pool filling a v5e,
    which then did not compile). Readers take the first `2K * page_size` lanes of a page's row;
    the extra pages' rows are never read."""
    num_layers, num_pages, num_kv_heads, page_size, _ = shape
    lanes = 2 * (num_kv_heads // shards) * page_size
    if (platform or current_platform()) == "tpu":
        lanes = -(-lanes // _TPU_LANES) * _TPU_LANES
        num_pages = -(-num_pages // 8) * 8
    return (num_layers, num_pages, 1, shards * lanes)


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
        want = scales_shape(data.shape, "cpu")  # or more lanes, where the platform pads them
        short = any(a < b for a, b in zip(scales.shape[1::2], want[1::2], strict=True))
        if scales.shape[::2] != want[::2] or short or scales.dtype != jnp.float32:
            raise ValueError(
                f"kv cache scales must be f32{list(want)} (or wider, see scales_shape), got "
                f"{scales.dtype}{list(scales.shape)}"
            )
    return kv_cache


def zeros_kv_cache(
    shape: tuple[int, ...], dtype, platform: str | None = None, shards: int = 1
) -> KVCache:
    """An empty cache of `shape` (`get_kv_cache_shape`) and `dtype` (float or 8-bit); an 8-bit
    cache's scales as `scales_shape(shape, platform, shards)` lays them out."""
    if not is_quantized_dtype(dtype):
        return KVCache(jnp.zeros(shape, dtype))
    data = jnp.zeros(shape, _STORAGE[_format(dtype)])
    return KVCache(data, jnp.zeros(scales_shape(shape, platform, shards), jnp.float32))


def abstract_kv_cache(shape: tuple[int, ...], dtype, sharding: KVCache | None = None) -> KVCache:
    """`zeros_kv_cache`'s result as `jax.ShapeDtypeStruct`s (with `sharding`'s leaves, whose
    devices' platform and split lay out the scales), for compiling a program without
    allocating the cache."""
    if not is_quantized_dtype(dtype):
        data = jax.ShapeDtypeStruct(
            shape, dtype, sharding=None if sharding is None else sharding[0]
        )
        return KVCache(data)
    data = jax.ShapeDtypeStruct(
        shape, _STORAGE[_format(dtype)], sharding=None if sharding is None else sharding[0]
    )
    platform, shards = None, 1
    if sharding is not None:
        platform = next(iter(sharding[1].device_set)).platform
        unpadded = scales_shape(shape, "cpu")
        shards = unpadded[3] // sharding[1].shard_shape(unpadded)[3]
    scales = jax.ShapeDtypeStruct(
        scales_shape(shape, platform, shards),
        jnp.float32,
        sharding=None if sharding is None else sharding[1],
    )
    return KVCache(data, scales)


def kv_bytes_per_token_head(head_dim: int, dtype) -> int:
    """Logical bytes a K or V head of one token takes in a cache of `dtype`, its scale
    included (a device may pad them: see the module doc)."""
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


def _interleaved(kv: jax.Array) -> jax.Array:
    """[..., K, 2H] rows -> [..., 2K, H]: row 2k is head k's key, 2k + 1 its value."""
    *lead, num_kv_heads, two_h = kv.shape
    return kv.reshape(*lead, 2 * num_kv_heads, two_h // 2)


def read_kv(kv_cache: KVCache, layer, pages: jax.Array, offsets: jax.Array | None = None):
    """float32 K/V of `pages` (any index shape) of one layer: [..., page_size, 2K, H] (row 2k
    the key of head k, 2k + 1 its value), or with `offsets` (same shape as `pages`) one token of
    each: [..., 2K, H]. For the jnp backends; an 8-bit cache is dequantized here, after the
    gather, so only what is read is widened."""
    data, scales = kv_cache
    _, _, num_kv_heads, page_size, _ = data.shape
    if offsets is None:
        kv = _interleaved(jnp.swapaxes(widen_kv(data[layer, pages]), -3, -2))  # [.., S, 2K, H]
        if scales is not None:
            s = scales[layer, pages, :, : 2 * num_kv_heads * page_size]
            s = s.reshape(*kv.shape[:-3], 2 * num_kv_heads, page_size)
            kv = kv * jnp.swapaxes(s, -1, -2)[..., None]
        return kv
    kv = _interleaved(widen_kv(data[layer, pages, :, offsets]))  # [..., 2K, H]
    if scales is not None:
        s = scales[layer, pages, 0, : 2 * num_kv_heads * page_size]
        s = s.reshape(*kv.shape[:-2], 2 * num_kv_heads, page_size)
        kv = kv * jnp.take_along_axis(s, offsets[..., None, None], axis=-1)
    return kv


def quantize_kv_cache(cache: jax.Array, dtype) -> KVCache:
    """A float cache `[L, num_pages, K, page_size, 2H]` as an 8-bit `KVCache` of `dtype`, each
    token's key and value quantized as `write_kv` does (for tests and benchmarks)."""
    num_layers, num_pages, num_kv_heads, page_size, head_dim = cache_dims(cache.shape)
    rows = cache.reshape(*cache.shape[:-1], 2, head_dim)  # [L, P, K, S, 2, H]
    data, scales = quantize_kv(rows, dtype)
    scales = jnp.swapaxes(scales, -1, -2).reshape(scales_shape(cache.shape, "cpu"))  # (k, j, t)
    return KVCache(data.reshape(cache.shape), scales)


def dequantize_kv_cache(kv_cache: KVCache) -> jax.Array:
    """An 8-bit cache's values as a float32 cache of the same layout (for checking)."""
    data, scales = kv_cache
    num_layers, num_pages, num_kv_heads, page_size, head_dim = cache_dims(data.shape)
    s = scales[:, :num_pages, :, : 2 * num_kv_heads * page_size]
    s = s.reshape(num_layers, num_pages, num_kv_heads, 2, page_size)
    s = jnp.repeat(jnp.swapaxes(s, -1, -2), head_dim, axis=-1)  # [L, P, K, S, 2H]
    return widen_kv(data) * s


# The lanes a TPU tiles an array's minor dimension by.
_TPU_LANES = 128


def cache_head_dim(head_dim: int, platform: str | None = None, *, latent: bool = False) -> int:
    """The width a key or value head takes in the cache on `platform` (default: the one
    kernels are traced for, `target.current_platform`): `head_dim` on the CPU; on a TPU a row
    of `2H` lanes that is not whole 128-lane tiles is padded to them (H 80 or 96 take 128, H 32
    takes 64); on a GPU H is padded to a power of two, the only widths Triton's blocks take
    (H 80 or 96 take 128).

    Unpadded on a TPU, XLA lays such a cache out with its pages as the minor dimension, and
    every kernel call copies it into the row-major layout the kernel reads (found by compiling
    head_dim 96 for v6e: 64 MiB of temporaries for a 48 MiB cache); padded, it is read in place
    and the pool is charged the bytes the tiles take anyway. On a GPU the kernel refused such
    heads. The padding lanes hold zeros, and queries are padded with zeros too
    (`ragged_paged_attention`), so scores and outputs are unchanged.

    `latent`: a latent attention cache (`mla_attention.py`), which keeps two tokens' rows
    (`2 * head_dim` lanes each) in one pair row of `4 * head_dim` lanes; the width returned is
    a quarter of that pair row as the platform lays it out: `head_dim` itself, or on a TPU
    more where the pair row is not whole 128-lane tiles (never for DeepSeek's 1,152)."""
    platform = platform or current_platform()
    if latent:
        lanes = 4 * head_dim
        if platform == "tpu":
            lanes = -(-lanes // _TPU_LANES) * _TPU_LANES
        return -(-lanes // 4)
    if platform == "tpu":
        return -(-2 * head_dim // _TPU_LANES) * _TPU_LANES // 2
    if platform in ("gpu", "cuda", "rocm"):
        return 1 << (head_dim - 1).bit_length()
    return head_dim


def get_kv_cache_shape(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    platform: str | None = None,
    *,
    latent: bool = False,
) -> tuple[int, int, int, int, int]:
    """The shape of the paged KV cache on `platform` (default: the one kernels are traced
    for): `[L, num_pages, K, page_size, 2 * cache_head_dim(head_dim, platform)]`; with
    `latent`, a latent attention cache of rows `2 * head_dim` wide, two tokens to a pair row:
    `[L, num_pages, K, page_size / 2, 4 * cache_head_dim(head_dim, platform, latent=True)]`
    (see `mla_attention.py`; `page_size` must be even)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    width = cache_head_dim(head_dim, platform, latent=latent)
    if latent:
        if page_size % 2:
            raise ValueError(
                f"a latent cache pairs tokens: page_size must be even, got {page_size}"
            )
        return (num_layers, num_pages, num_kv_heads, page_size // 2, 4 * width)
    return (num_layers, num_pages, num_kv_heads, page_size, 2 * width)


def cache_dims(shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """(num_layers, num_pages, num_kv_heads, page_size, head width) of a cache of `shape`: the
    width is `cache_head_dim`, the model's head_dim or more where the platform pads it."""
    num_layers, num_pages, num_kv_heads, page_size, two_h = shape
    return num_layers, num_pages, num_kv_heads, page_size, two_h // 2


def write_kv(
    kv_cache: jax.Array | KVCache,  # [L, num_pages, K, page_size, 2H]
    layer: jax.Array | int,  # i32[]  the layer to write
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= num_slots means padding
) -> jax.Array | KVCache:
    """Writes the new tokens' keys and values into their slots of one layer; returns the cache
    in the form it was given (an array, or a `KVCache`, whose 8-bit data is quantized here).
    Heads narrower than the cache's (`cache_head_dim`) are padded with zeros.

    Slots at or past `num_pages * page_size` are dropped: the runner marks padding tokens with
    such a slot. (Negative slots would wrap around, so padding must never use -1.)

    The scatter addresses the cache in its own shape (layer, page, offset): reshaping the cache
    to merge pages and offsets would be a relayout copy on a TPU, whose tiles hold the offsets.
    """
    cache = as_kv_cache(kv_cache)
    num_layers, num_pages, num_kv_heads, page_size, head_dim = cache_dims(cache.shape)
    num_tokens = k.shape[0]
    if k.shape != v.shape or k.ndim != 3 or k.shape[1] != num_kv_heads or k.shape[2] > head_dim:
        raise ValueError(
            f"k and v must be [T, {num_kv_heads}, H <= {head_dim}] for this cache; got k "
            f"{k.shape}, v {v.shape}"
        )
    if k.shape[2] < head_dim:  # the platform's padded width (`cache_head_dim`)
        pad = ((0, 0), (0, 0), (0, head_dim - k.shape[2]))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {slot_mapping.shape}")
    kv = jnp.stack([k, v], axis=2)  # [T, K, 2, H]
    if cache.quantized:
        kv, scales = quantize_kv(kv, cache.dtype)  # [T, K, 2, H], [T, K, 2]
    else:
        kv, scales = kv.astype(cache.dtype), None
    kv = kv.reshape(num_tokens, num_kv_heads, 2 * head_dim)
    # The new rows are computed before the scatter, not inside it. Without the barrier
    # XLA:GPU fused a one-token step's K/V projection (a matrix-vector product, not a GEMM
    # there) and its RoPE into the scatter kernel, which computed each of its few thousand
    # elements as its own 4096-long dot product: 355 us per layer, 11 of the 21 ms of an
    # 8B decode step on an H200 (benchmarks/results/gpu-h200-checks.md).
    kv, scales = jax.lax.optimization_barrier((kv, scales))
    kv, scales, slot_mapping = keep_a_scatter(kv, scales, slot_mapping, num_pages * page_size)
    # A padding slot's page is past the last one, so FILL_OR_DROP drops its row.
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    layers = jnp.broadcast_to(jnp.asarray(layer, slot_mapping.dtype), slot_mapping.shape)
    # One [2H] row per (token, kv head): a window over the heads as well made XLA:TPU lay the
    # cache out heads-minor for the scatter and copy it back for the kernel, at every layer.
    heads = jnp.arange(num_kv_heads, dtype=slot_mapping.dtype)
    index = jnp.stack(
        jnp.broadcast_arrays(layers[:, None], page[:, None], heads[None, :], offset[:, None]),
        axis=-1,
    )  # [T, K, 4]: (layer, page, head, offset)
    # lax.scatter rather than `.at[layer, page, head, offset].set`: the same op, a tenth of the
    # tracing (the model traces it once per layer for every compiled shape at startup).
    data = jax.lax.scatter(
        cache.data,
        index,
        kv,  # [T, K, 2H]
        jax.lax.ScatterDimensionNumbers(
            update_window_dims=(2,),
            inserted_window_dims=(0, 1, 2, 3),
            scatter_dims_to_operand_dims=(0, 1, 2, 3),
        ),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )
    if not cache.quantized:
        return data if not isinstance(kv_cache, KVCache) else KVCache(data)
    # Token t's 2K scales go to lanes (2k + j) * page_size + offset of its page's row.
    lanes = jnp.arange(2 * num_kv_heads, dtype=slot_mapping.dtype) * page_size
    lanes = lanes[None, :] + offset[:, None]  # [T, 2K]
    new_scales = scatter_scales(cache.scales, layers, page, lanes, scales.reshape(-1, 2 * num_kv_heads))  # fmt: skip
    return KVCache(data, new_scales)


def keep_a_scatter(
    rows: jax.Array, scales: jax.Array | None, slot_mapping: jax.Array, num_slots: int
):
    """A cache write's (rows, scales, slot_mapping), with a second row, dropped, when it writes
    one token. XLA rewrites a one-row scatter as a dynamic-update-slice that reads the old row
    back (to keep it if the slot is out of range), and that second use of the cache makes it
    copy the whole cache, every step (measured: 1.1 GB of temporaries and seconds per decode
    step for the demo model). `num_slots`: the pool's, the dropped row's slot."""  # fmt: skip
    if slot_mapping.shape[0] != 1:
        return rows, scales, slot_mapping
    rows = jnp.concatenate([rows, rows])
    scales = None if scales is None else jnp.concatenate([scales, scales])
    slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), num_slots, slot_mapping.dtype)])
    return rows, scales, slot_mapping


def scatter_scales(
    scales: jax.Array,  # [L, num_pages, 1, lanes]  an 8-bit cache's scale rows
    layers: jax.Array,  # i32[T]  each token's layer slot
    page: jax.Array,  # i32[T]  its page (past the pool: dropped)
    lanes: jax.Array,  # i32[T, N]  the lanes of its page's row its scales go to
    values: jax.Array,  # [T, N]  its scales
) -> jax.Array:
    """Writes each token's scales into their lanes of its page's scale row."""
    index = jnp.stack(jnp.broadcast_arrays(layers[:, None], page[:, None], lanes), axis=-1)
    return jax.lax.scatter(
        scales,
        index,  # [T, N, 3]: (layer, page, lane)
        values[..., None],  # [T, N, 1]: the size-1 axis 2 of scales
        jax.lax.ScatterDimensionNumbers(
            update_window_dims=(2,),
            inserted_window_dims=(0, 1, 3),
            scatter_dims_to_operand_dims=(0, 1, 3),
        ),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def attention_cost(
    q_shape: tuple[int, int, int],
    q_dtype,
    cache_shape: tuple[int, ...],
    cache_dtype,
    block_tables_shape: tuple[int, int],
    quantized: bool,
) -> tuple[int, int, int]:
    """(flops, transcendentals, bytes accessed) of one attention call over one layer, as the
    kernels declare it to their compilers (`pl.CostEstimate`): an upper bound, every request
    that can have a query at the full reach of its block table (capped by the pool), since
    the lengths are data. A request without a query token reads nothing, so no more than
    `num_tokens` requests read (a one-token decode step reads one block table's pages, not
    the whole pool the block tables could reach). The compilers' cost analyses of whole
    programs count the kernels by these figures."""
    num_tokens, num_heads, head_dim = q_shape
    _, num_pages, num_kv_heads, page_size, _ = cache_shape
    max_reqs, pages_per_seq = block_tables_shape
    pages = min(min(num_tokens, max_reqs) * pages_per_seq, num_pages)
    page_bytes = num_kv_heads * page_size * 2 * head_dim * jnp.dtype(cache_dtype).itemsize
    if quantized:
        page_bytes += 2 * num_kv_heads * page_size * 4
    keys = min(pages_per_seq, num_pages) * page_size  # the most keys one query sees
    pairs = num_tokens * num_heads * keys
    q_bytes = num_tokens * num_heads * head_dim * jnp.dtype(q_dtype).itemsize
    return 4 * head_dim * pairs, pairs, pages * page_bytes + 2 * q_bytes
