"""Ragged paged attention in plain JAX: the ground truth and the CPU default.

One call serves a batch that mixes prefills, chunked prefills and decodes. The queries of all
scheduled tokens are flattened (`[T, N, H]`); request r owns rows `cu_q_lens[r]:cu_q_lens[r+1]`,
which are the last `q_len` of its `seq_lens[r]` tokens (their K/V are already in the cache).
Rows past `cu_q_lens[num_seqs]` are padding: they read nothing and return zeros.

Each query row attends to two parts of its sequence, merged by one online softmax:
- the step's own tokens (the "self" part): their K/V are read back from their slots and all
  rows are scored against all of them in one dense `[T, T]` matmul, masked to the same
  request and causal order. A whole prefill is just this part, with no gathering;
- the request's context cached before this step: walked in chunks of `C` kv tokens, each row
  gathering its own request's pages. The loop runs only as far as the longest context in the
  batch (a `fori_loop` with a traced bound), so a short batch costs little even when the
  block table is wide.
Masked keys and values are zeroed before use, so garbage or NaN in unused pages can never leak
into the result.

The mask is causal and, where `sliding_window` (an i32[] operand, possibly traced) is w >= 1,
limited to the last w positions: a query at position q sees key k iff q - w < k <= q. A window
<= 0 is full attention; a constant one folds away under jit. `attend_to` widens the causal
order of a query to the step's keys up to its entry (the self part alone holds them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention_sinks import fold_sink
from pallas_kernels.kv_cache import KVCache, read_kv

# The chunk length C: at most _CHUNK_TOKENS kv tokens (so a short context costs little even
# when its block table is wide) and at most _CHUNK_BYTES of K/V gathered for all T rows.
_CHUNK_TOKENS = 32
_CHUNK_BYTES = 32 * 1024 * 1024


def _chunk_pages(num_rows: int, page_size: int, kh2: int, head_dim: int, max_pages: int) -> int:
    """Pages per kv chunk: as many as fit `_CHUNK_BYTES` for all rows, at least one."""
    per_page = num_rows * page_size * kh2 * head_dim * 4
    pages = min(_CHUNK_BYTES // per_page, _CHUNK_TOKENS // page_size, max_pages)
    return int(max(pages, 1))


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, K, page_size, 2H]
    layer: jax.Array | int,  # i32[]      which layer of the cache to read
    seq_lens: jax.Array,  # i32[R]      tokens in the cache per request, this step's included
    block_tables: jax.Array,  # i32[R, P]   page ids per request
    cu_q_lens: jax.Array,  # i32[R + 1]  query start offsets
    num_seqs: jax.Array,  # i32[1]      valid requests; the rest of R is padding
    *,
    sm_scale: float,
    sliding_window: jax.Array,  # i32[]      keys a query sees back from itself; <= 0: all
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,  # f32[L, num_pages, 1, 2K * page_size]  8-bit only
    attend_to: jax.Array | None = None,  # i32[T]  see `ragged_paged_attention`
    sinks: jax.Array | None = None,  # f32[N]  see `ragged_paged_attention`
    attention_chunk: int | None = None,  # static  see `ragged_paged_attention`
) -> jax.Array:  # [T, N, H]
    cache = KVCache(kv_cache, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_size, _ = kv_cache.shape
    kh2 = 2 * num_kv_heads
    group = num_heads // num_kv_heads
    max_reqs, pages_per_seq = block_tables.shape

    # Token -> request, and the token's position in its sequence.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, max_reqs - 1)
    valid = t < cu_q_lens[num_seqs[0]]  # [T]
    q_start = cu_q_lens[req]
    q_len = cu_q_lens[req + 1] - q_start
    pos = jnp.where(valid, seq_lens[req] - q_len + (t - q_start), 0)  # [T]
    context_len = jnp.where(valid, seq_lens[req] - q_len, 0)  # [T] tokens cached before

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale

    def softcap(s):
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    def in_window(kv_pos, q_pos):
        """Within the sliding window and, with `attention_chunk`, the query's chunk."""
        seen = (sliding_window <= 0) | (kv_pos > q_pos - sliding_window)
        if attention_chunk is not None:
            seen &= kv_pos >= q_pos // attention_chunk * attention_chunk
        return seen

    # The self part: the step's tokens, read back from the slots they were written to.
    page = block_tables[req, jnp.clip(pos // page_size, 0, pages_per_seq - 1)]
    new_kv = read_kv(cache, layer, page, pos % page_size)  # [T, 2K, H]
    new_kv = jnp.where(valid[:, None, None], new_kv, 0.0)
    new_kv = new_kv.reshape(num_tokens, num_kv_heads, 2, head_dim)
    k_new, v_new = new_kv[:, :, 0], new_kv[:, :, 1]  # [T, K, H]
    causal = t[None, :] <= t[:, None]
    if attend_to is not None:  # a block's tokens see each other (keys of this step)
        causal |= pos[None, :] <= attend_to[:, None]
    self_mask = (req[:, None] == req[None, :]) & causal
    self_mask &= valid[:, None] & valid[None, :] & in_window(pos[None, :], pos[:, None])
    # Head-major ("ktg...") so each kv head is one plain [T*G, H] x [H, T] matmul.
    qk = qg.transpose(1, 0, 2, 3)  # [K, T, G, H]
    s = softcap(jnp.einsum("ktgh,kuh->ktgu", qk, k_new.transpose(1, 0, 2)))
    s = jnp.where(self_mask[None, :, None, :], s, -jnp.inf)
    m = s.max(axis=-1)  # finite for every valid row: a token always sees itself
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("ktgu,kuh->ktgh", p, v_new.transpose(1, 0, 2))
    carry = (m.transpose(1, 0, 2), p.sum(axis=-1).transpose(1, 0, 2), acc.transpose(1, 0, 2, 3))

    # The context part, chunk by chunk, with an online softmax.
    chunk_pages = _chunk_pages(num_tokens, page_size, kh2, head_dim, pages_per_seq)
    chunk = chunk_pages * page_size
    padded_pages = -(-pages_per_seq // chunk_pages) * chunk_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))[req]  # [T, P']
    num_chunks = (jnp.max(context_len) + chunk - 1) // chunk

    def body(c, carry):
        m, l, acc = carry  # [T, K, G], [T, K, G], [T, K, G, H]
        pages = jax.lax.dynamic_slice_in_dim(tables, c * chunk_pages, chunk_pages, axis=1)
        kv = read_kv(cache, layer, pages).reshape(num_tokens, chunk, num_kv_heads, 2, head_dim)
        s_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        mask = (s_pos[None, :] < context_len[:, None]) & in_window(s_pos[None, :], pos[:, None])
        kv = jnp.where(mask[:, :, None, None, None], kv, 0.0)
        k, v = kv[..., 0, :], kv[..., 1, :]  # [T, C, K, H]
        s = softcap(jnp.einsum("tkgh,tckh->tkgc", qg, k))
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))  # finite: m already is
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckh->tkgh", p, v)
        return m_new, l, acc

    m, l, acc = jax.lax.fori_loop(0, num_chunks, body, carry)
    if sinks is not None:
        l, alpha = fold_sink(m, l, sinks.reshape(num_kv_heads, group))
        acc = alpha[..., None] * acc
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
