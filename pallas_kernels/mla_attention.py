"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache, in plain JAX: the
absorbed form, which attends in the latent space, so one cached row per token serves every
head.

The cache keeps, per token, its row `[c_kv | k_pe]`: its normalised latent (L wide) and its
RoPE key (R wide), 576 values for V3, and nothing per head. It is a paged cache of
`kv_cache.py` with one "kv head" (one per device under tensor parallelism, each a copy) whose
pages pair tokens: page offset t lives in pair row t // 2 of its page,
`get_kv_cache_shape(..., latent=True)` = `[layers, pages, 1, page_size / 2, lanes]`, laid out

    lanes [0, L)         c_kv of the even token      [2L, 2L + R)      k_pe of the even token
          [L, 2L)        c_kv of the odd token       [2L + R, 2L + 2R) k_pe of the odd token

and zeros past 2(L + R). Why pairs: a TPU tiles an array's minor dimension by 128 lanes, and
a row of 576 is 4.5 tiles, which the TPU would pad to 640 (tpu-inference's layout pays that,
11% of the cache); two rows are 1,152 = 9 tiles, and every part sits on a tile boundary for
the kernel (`mla_attention_tpu.py`) to slice. On CPUs and GPUs the layout costs nothing either
way. An 8-bit cache quantizes each token's row with one scale (`scales` lane `t` of its page's
row, per copy lane `k * page_size + t`).

The queries arrive absorbed (`jaxllm.models.mla`): each head's non-RoPE query already
multiplied into the latent space (`ql = q_nope W_UK`, [T, N, L]) beside its RoPE query
(`q_pe`, [T, N, R]). A head's score against token j is `[ql | q_pe] . row_j`, its output the
softmax-weighted sum of the rows' latents `c_kv` ([T, N, L]), which the caller projects by
W_UV. That is exactly the expanded attention (keys `[W_UK c_kv | k_pe]`, values `W_UV c_kv`)
reassociated, with the softmax scale of the expanded head width.

Batches are ragged as in `ragged_paged_attention`: request r's queries are rows
`cu_q_lens[r]:cu_q_lens[r + 1]`, the last `q_len` of its `seq_lens[r]` tokens, whose rows are
already written. Each query attends causally to its request's rows: the step's own tokens in
one dense masked product, the context cached before the step in chunks of pages with an
online softmax (the loop bounded by the batch's longest context), as the reference GQA kernel
does. `mla_paged_attention` runs this where no kernel is asked for; "pallas_gpu" is a Triton
kernel (`mla_attention_gpu.py`), "pallas_tpu" a Mosaic one (`mla_attention_tpu.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import (
    KVCache,
    as_kv_cache,
    keep_a_scatter,
    quantize_kv,
    scatter_scales,
    widen_kv,
)
from pallas_kernels.mla_attention_gpu import mla_paged_attention_gpu
from pallas_kernels.mla_attention_tpu import mla_paged_attention_tpu
from pallas_kernels.target import current_platform

# At most this many context tokens per chunk, and this many bytes of rows gathered for the
# batch's queries at once.
_CHUNK_TOKENS = 64
_CHUNK_BYTES = 32 * 1024 * 1024


def check_latent_cache(cache: KVCache, latent: int, rope: int) -> None:
    """Refuses a cache that cannot hold rows of `latent + rope` in pairs (module doc)."""
    _, _, copies, _, lanes = cache.shape
    if copies != 1 or lanes < 2 * (latent + rope):
        raise ValueError(
            f"latent attention needs a cache of one kv head whose pair rows hold "
            f"{2 * (latent + rope)} lanes (latent {latent} + RoPE {rope}, two tokens); got "
            f"{cache.shape}"
        )


def read_latent(
    cache: KVCache, layer, pages: jax.Array, offsets: jax.Array | None = None, *, latent: int,
    rope: int,
) -> jax.Array:  # fmt: skip
    """float32 rows `[c_kv | k_pe]` of `pages` (any index shape) of one layer, copy 0:
    `[..., page_size, L + R]`, or with `offsets` (same shape as `pages`) one token of each:
    `[..., L + R]`; an 8-bit cache dequantized after the gather."""
    data, scales = cache
    page_size = 2 * data.shape[3]
    if offsets is None:
        x = widen_kv(data[layer, pages, 0])  # [..., S/2, lanes]
        c = jnp.stack([x[..., :latent], x[..., latent : 2 * latent]], axis=-2)
        pe = x[..., 2 * latent : 2 * (latent + rope)].reshape(*x.shape[:-1], 2, rope)
        rows = jnp.concatenate([c, pe], axis=-1).reshape(*x.shape[:-2], page_size, latent + rope)
        if scales is not None:
            rows = rows * scales[layer, pages, 0, :page_size][..., None]
        return rows
    x = widen_kv(data[layer, pages, 0, offsets // 2])  # [..., lanes]
    odd = (offsets % 2 == 1)[..., None]
    c = jnp.where(odd, x[..., latent : 2 * latent], x[..., :latent])
    pe_at = 2 * latent
    pe = jnp.where(odd, x[..., pe_at + rope : pe_at + 2 * rope], x[..., pe_at : pe_at + rope])
    rows = jnp.concatenate([c, pe], axis=-1)
    if scales is not None:
        rows = rows * scales[layer, pages, 0, offsets][..., None]
    return rows


def mla_paged_attention(
    ql: jax.Array,  # [T, N, L]  queries in the latent space
    q_pe: jax.Array,  # [T, N, R]  RoPE queries
    kv_cache: jax.Array | KVCache,  # [layers, num_pages, 1, page_size / 2, >= 2(L + R)]
    layer: jax.Array | int,  # the cache slot to read
    seq_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    backend: str = "reference",
    interpret: bool | None = None,
) -> jax.Array:  # f32[T, N, L]: each head's softmax-weighted latent
    """Latent attention by `backend`: "pallas_gpu" is the Triton kernel
    (`mla_attention_gpu.py`), "pallas_tpu" the Mosaic kernel (`mla_attention_tpu.py`), each
    interpreted off its platform unless `interpret` says otherwise; every other backend this
    module's plain JAX."""
    args = (ql, q_pe, kv_cache, layer, seq_lens, block_tables, cu_q_lens, num_seqs)
    if backend not in ("pallas_gpu", "pallas_tpu"):
        return mla_paged_attention_reference(*args, sm_scale=sm_scale)
    cache = as_kv_cache(kv_cache)
    check_latent_cache(cache, ql.shape[-1], q_pe.shape[-1])
    platform = "gpu" if backend == "pallas_gpu" else "tpu"
    if interpret is None:
        interpret = current_platform() != platform
    kernel = mla_paged_attention_gpu if platform == "gpu" else mla_paged_attention_tpu
    # The kernels' dots in the model's dtype (q_pe's), as the GQA kernels' are in q's: a
    # float32 latent query would double their blocks' memory.
    return kernel(
        ql.astype(q_pe.dtype), q_pe, cache.data, *args[3:], sm_scale=sm_scale,
        kv_scales=cache.scales, interpret=interpret,
    )  # fmt: skip


def mla_paged_attention_reference(
    ql: jax.Array,  # [T, N, L]  queries in the latent space
    q_pe: jax.Array,  # [T, N, R]  RoPE queries
    kv_cache: jax.Array | KVCache,  # [layers, num_pages, 1, page_size, 2W], W >= (L + R) / 2
    layer: jax.Array | int,  # the cache slot to read
    seq_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
) -> jax.Array:  # f32[T, N, L]: each head's softmax-weighted latent
    cache = as_kv_cache(kv_cache)
    num_tokens, num_heads, latent = ql.shape
    rope = q_pe.shape[-1]
    width = latent + rope
    check_latent_cache(cache, latent, rope)
    page_size = 2 * cache.shape[3]
    max_reqs, pages_per_seq = block_tables.shape

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, max_reqs - 1)
    valid = t < cu_q_lens[num_seqs[0]]
    q_start = cu_q_lens[req]
    q_len = cu_q_lens[req + 1] - q_start
    pos = jnp.where(valid, seq_lens[req] - q_len + (t - q_start), 0)
    context_len = jnp.where(valid, seq_lens[req] - q_len, 0)

    q = jnp.concatenate([ql, q_pe], axis=-1).astype(jnp.float32) * sm_scale  # [T, N, L + R]

    # The step's own tokens, read back from their slots.
    page = block_tables[req, jnp.clip(pos // page_size, 0, pages_per_seq - 1)]
    new = read_latent(cache, layer, page, pos % page_size, latent=latent, rope=rope)  # [T, L+R]
    new = jnp.where(valid[:, None], new, 0.0)
    mask = (req[:, None] == req[None, :]) & (t[None, :] <= t[:, None])
    mask &= valid[:, None] & valid[None, :]
    s = jnp.einsum("tnd,ud->tnu", q, new)
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = s.max(axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    carry = (m, p.sum(axis=-1), jnp.einsum("tnu,ul->tnl", p, new[:, :latent]))

    # The context cached before the step, chunk by chunk.
    per_page = num_tokens * page_size * width * 4
    chunk_pages = min(_CHUNK_BYTES // per_page, _CHUNK_TOKENS // page_size, pages_per_seq)
    chunk_pages = int(max(chunk_pages, 1))
    chunk = chunk_pages * page_size
    padded = -(-pages_per_seq // chunk_pages) * chunk_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))[req]  # [T, P']
    num_chunks = (jnp.max(context_len) + chunk - 1) // chunk

    def body(c, carry):
        m, l, acc = carry  # [T, N], [T, N], [T, N, L]
        pages = jax.lax.dynamic_slice_in_dim(tables, c * chunk_pages, chunk_pages, axis=1)
        rows = read_latent(cache, layer, pages, latent=latent, rope=rope)
        rows = rows.reshape(num_tokens, chunk, width)
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        seen = k_pos[None, :] < context_len[:, None]  # [T, C]
        rows = jnp.where(seen[..., None], rows, 0.0)
        s = jnp.einsum("tnd,tcd->tnc", q, rows)
        s = jnp.where(seen[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tnc,tcl->tnl", p, rows[..., :latent])
        return m_new, l, acc

    m, l, acc = jax.lax.fori_loop(0, num_chunks, body, carry)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def write_latent(
    kv_cache: jax.Array | KVCache,  # [layers, num_pages, K, page_size / 2, >= 2(L + R)]
    layer: jax.Array | int,  # i32[]  the layer slot to write
    c_kv: jax.Array,  # [T, K, L]  each token's latent, K copies (one per device's slot)
    k_pe: jax.Array,  # [T, K, R]  its RoPE key
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= num_slots: padding
) -> jax.Array | KVCache:
    """Writes each token's row into its half of its pair row (module doc), an 8-bit cache's
    quantized under one scale per row; returns the cache in the form it was given. As
    `kv_cache.write_kv` does: slots past the pool are dropped, the rows are computed before
    the scatters (an optimization barrier), and a one-token write stays a scatter."""
    cache = as_kv_cache(kv_cache)
    _, num_pages, copies, pairs, lanes = cache.shape
    page_size = 2 * pairs
    num_tokens, _, latent = c_kv.shape
    rope = k_pe.shape[-1]
    if c_kv.shape[1] != copies or k_pe.shape[:2] != c_kv.shape[:2]:
        raise ValueError(
            f"c_kv and k_pe must be [T, {copies}, L] and [T, {copies}, R] for this cache; got "
            f"{c_kv.shape} and {k_pe.shape}"
        )
    if lanes < 2 * (latent + rope):
        raise ValueError(f"a cache of {lanes} lanes cannot hold pairs of {latent + rope}-wide rows")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {slot_mapping.shape}")
    rows = jnp.concatenate([c_kv, k_pe], axis=-1)  # [T, K, L + R]
    if cache.quantized:
        rows, scales = quantize_kv(rows, cache.dtype)  # [T, K, L + R], [T, K]
    else:
        rows, scales = rows.astype(cache.data.dtype), None
    rows, scales = jax.lax.optimization_barrier((rows, scales))  # see write_kv
    rows, scales, slot_mapping = keep_a_scatter(rows, scales, slot_mapping, num_pages * page_size)
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    odd = offset % 2
    layers = jnp.broadcast_to(jnp.asarray(layer, slot_mapping.dtype), slot_mapping.shape)
    heads = jnp.arange(copies, dtype=slot_mapping.dtype)

    def index(lane):  # [T, K, 5]: (layer, page, copy, pair row, first lane)
        parts = (layers[:, None], page[:, None], heads[None, :], offset[:, None] // 2, lane)
        return jnp.stack(jnp.broadcast_arrays(*parts), axis=-1)

    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2,),
        inserted_window_dims=(0, 1, 2, 3),
        scatter_dims_to_operand_dims=(0, 1, 2, 3, 4),
    )
    data = cache.data
    for lane, part in (
        (odd * latent, rows[..., :latent]),
        (2 * latent + odd * rope, rows[..., latent:]),
    ):
        data = jax.lax.scatter(
            data, index(lane[:, None]), part, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP
        )
    if scales is None:
        return data if not isinstance(kv_cache, KVCache) else KVCache(data)
    lane = heads[None, :] * page_size + offset[:, None]  # [T, K]: one scale a row
    return KVCache(data, scatter_scales(cache.scales, layers, page, lane, scales))
