"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache, in plain JAX: the
absorbed form, which attends in the latent space, so one cached row per token serves every
head.

The cache is the paged KV cache of `kv_cache.py` with one "kv head" whose key and value lanes
together hold a token's row `[c_kv | k_pe]`: its normalised latent (L wide) and its RoPE key
(R wide), L + R = 2H (576 = 2 x 288 for V3; an odd row ends in a zero lane). A TPU pads each
half to whole tiles (`cache_head_dim`), and the halves are read back without the padding.
An 8-bit cache quantizes each half with its own scale, like a key and a value.

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
does. `mla_paged_attention` runs this on every backend but "pallas_gpu", a Triton kernel
(`mla_attention_gpu.py`); no TPU kernel yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import KVCache, as_kv_cache, read_kv, write_kv
from pallas_kernels.mla_attention_gpu import mla_paged_attention_gpu
from pallas_kernels.target import current_platform

# At most this many context tokens per chunk, and this many bytes of rows gathered for the
# batch's queries at once.
_CHUNK_TOKENS = 64
_CHUNK_BYTES = 32 * 1024 * 1024


def _rows(kv: jax.Array, half: int, width: int) -> jax.Array:
    """[..., 2, W] key and value lanes read back -> [..., width]: the row, unpadded."""
    return jnp.concatenate([kv[..., 0, :half], kv[..., 1, :half]], axis=-1)[..., :width]


def mla_paged_attention(
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
    backend: str = "reference",
    interpret: bool | None = None,
) -> jax.Array:  # f32[T, N, L]: each head's softmax-weighted latent
    """Latent attention by `backend`: "pallas_gpu" is the Triton kernel
    (`mla_attention_gpu.py`; interpreted off a GPU unless `interpret` says otherwise), every
    other backend this module's plain JAX."""
    args = (ql, q_pe, kv_cache, layer, seq_lens, block_tables, cu_q_lens, num_seqs)
    if backend != "pallas_gpu":
        return mla_paged_attention_reference(*args, sm_scale=sm_scale)
    cache = as_kv_cache(kv_cache)
    if interpret is None:
        interpret = current_platform() != "gpu"
    # The kernel's dots in the model's dtype (q_pe's), as the GQA kernel's are in q's: a
    # float32 latent query would double its blocks' shared memory.
    return mla_paged_attention_gpu(
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
    width = latent + q_pe.shape[-1]
    half = -(-width // 2)  # an odd row's last lane is a zero
    _, _, kv_heads, page_size, lanes = cache.shape
    if kv_heads != 1 or lanes < 2 * half:
        raise ValueError(
            f"latent attention needs a cache of one kv head whose rows hold {width} lanes "
            f"(latent {latent} + RoPE {q_pe.shape[-1]}); got {cache.shape}"
        )
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
    new = _rows(read_kv(cache, layer, page, pos % page_size), half, width)  # [T, L + R]
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
        kv = read_kv(cache, layer, pages)  # [T, chunk_pages, page_size, 2, W]
        rows = _rows(kv, half, width).reshape(num_tokens, chunk, width)
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
    kv_cache: jax.Array | KVCache,
    layer: jax.Array | int,
    rows: jax.Array,  # [T, K, 2H]: each token's row, K copies (one per device's slot)
    slot_mapping: jax.Array,  # i32[T]
) -> jax.Array | KVCache:
    """Writes each token's row [c_kv | k_pe] (an odd one padded with a zero lane) into its
    slot: the first half in the key lanes, the second in the value lanes (`write_kv`, which
    pads each to the cache's width)."""
    half = rows.shape[-1] // 2
    return write_kv(kv_cache, layer, rows[..., :half], rows[..., half:], slot_mapping)
