"""Ragged paged attention in plain JAX: the ground truth and the CPU default.

One call serves a batch that mixes prefills, chunked prefills and decodes. The queries of all
scheduled tokens are flattened (`[T, N, H]`); request r owns rows `cu_q_lens[r]:cu_q_lens[r+1]`,
which are the last `q_len` of its `seq_lens[r]` tokens (their K/V are already in the cache).
Rows past `cu_q_lens[num_seqs]` are padding: they read nothing and return zeros.

Data flow: each query row looks up its request, then walks that request's pages in chunks of
`C` kv tokens with an online softmax. The loop runs only as far as the longest sequence in the
batch (a `fori_loop` with a traced bound), so a short batch costs little even when the block
table is wide. Masked keys and values are zeroed before use, so garbage or NaN in unused pages
can never leak into the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The chunk length C: at most _CHUNK_TOKENS kv tokens (so a short sequence costs little
# even when its block table is wide) and at most _CHUNK_BYTES of K/V gathered for all T rows.
_CHUNK_TOKENS = 32
_CHUNK_BYTES = 32 * 1024 * 1024


def _chunk_pages(num_tokens: int, page_size: int, kh2: int, head_dim: int, max_pages: int) -> int:
    """Pages per kv chunk: as many as fit `_CHUNK_BYTES` for all T rows, at least one."""
    per_page = num_tokens * page_size * kh2 * head_dim * 4
    pages = min(_CHUNK_BYTES // per_page, _CHUNK_TOKENS // page_size, max_pages)
    return int(max(pages, 1))


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
    layer: jax.Array | int,  # i32[]  which layer of the cache to read
    seq_lens: jax.Array,  # i32[R]      tokens in the cache per request, this step's included
    block_tables: jax.Array,  # i32[R, P]   page ids per request
    cu_q_lens: jax.Array,  # i32[R + 1]  query start offsets
    num_seqs: jax.Array,  # i32[1]      valid requests; the rest of R is padding
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, N, H]
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, kh2, _ = kv_cache.shape
    num_kv_heads = kh2 // 2
    group = num_heads // num_kv_heads
    max_reqs, pages_per_seq = block_tables.shape

    # Token -> request, and the token's position among its request's kv tokens.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, max_reqs - 1)
    valid = t < cu_q_lens[num_seqs[0]]
    q_start = cu_q_lens[req]
    q_len = cu_q_lens[req + 1] - q_start
    kv_len = jnp.where(valid, seq_lens[req], 0)  # [T]
    pos = kv_len - q_len + (t - q_start)  # [T]

    chunk_pages = _chunk_pages(num_tokens, page_size, kh2, head_dim, pages_per_seq)
    chunk = chunk_pages * page_size
    padded_pages = -(-pages_per_seq // chunk_pages) * chunk_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))[req]  # [T, P']

    live = jnp.arange(max_reqs) < num_seqs[0]
    max_kv_len = jnp.max(jnp.where(live, seq_lens, 0))
    num_chunks = (max_kv_len + chunk - 1) // chunk

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale

    def body(c, carry):
        m, l, acc = carry  # [T, K, G], [T, K, G], [T, K, G, H]
        pages = jax.lax.dynamic_slice_in_dim(tables, c * chunk_pages, chunk_pages, axis=1)
        kv = kv_cache[layer, pages].reshape(num_tokens, chunk, num_kv_heads, 2, head_dim)
        s_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        mask = (s_pos[None, :] <= pos[:, None]) & (s_pos[None, :] < kv_len[:, None])  # [T, C]
        if sliding_window is not None:
            mask &= s_pos[None, :] > pos[:, None] - sliding_window
        kv = jnp.where(mask[:, :, None, None, None], kv.astype(jnp.float32), 0.0)
        k, v = kv[..., 0, :], kv[..., 1, :]  # [T, C, K, H]
        s = jnp.einsum("tkgh,tckh->tkgc", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckh->tkgh", p, v)
        return m_new, l, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
