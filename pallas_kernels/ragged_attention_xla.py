"""Ragged paged attention in plain XLA, shaped for the CPU: the default backend there.

Same contract as the reference (`ragged_attention_reference.py`, the ground truth it is tested
against): a batch mixing decodes, prefills and chunked prefills, this step's K/V already
written to the cache. What it changes is how the work is laid out, after profiling the
reference on a 2-core CPU (demo model: a one-token decode step spent more time in attention
than in the 30 layers' matmuls at 1k context; a 512-token chunk after 512 cached tokens
gathered 400 MB per layer):

- The reference gathers K/V once per query row, 32 tokens at a time, plus a dense [T, T]
  "self" part. Gathering per row is right for a decode (one row is one request) and ruinous
  for a prefill chunk (every row of the chunk gathers the same pages again), and a short chunk
  makes a long loop of small ops.
- Here every row is served by exactly one of two passes, both of which read the step's own K/V
  back from the cache (no separate self part):
  * the decode pass: requests with one query row. One row per request (R rows, not T), each
    walking its own pages in chunks of 128 tokens while the longest context is short, else 512
    (or fewer, to fit a byte budget for R rows): a 1k context is two iterations, not 32;
  * the prefill pass: requests with several query rows. Their pages are laid end to end in
    one packed stream (request after request, whole pages); each chunk of the stream is
    gathered once and all T rows score it as one matmul, masked to their own request and to
    causal order. So a prefill's pages are gathered once per step, not once per row, and
    several short prompts in one step cost one pass over their combined length.
- Loop trip counts are traced: each pass runs only as far as its longest sequence (the packed
  stream: its total length), so a pass with nothing to do costs a few setup ops.
- Masked K/V are zeroed before use, so NaN or garbage in unused pages never reaches the output.
- The sliding window is an i32[] operand (<= 0: none), possibly traced, applied as a mask like
  the reference's; a constant one folds away under jit. Neither pass skips the pages before
  the window: both only mask them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention_sinks import fold_sink
from pallas_kernels.kv_cache import KVCache, read_kv

# Bytes of K/V (as f32) one decode chunk may gather for all R rows, and the chunk lengths:
# short contexts take the short chunk (fewer bytes gathered and copied), longer ones the long
# chunk (fewer loop iterations); `lax.cond` picks per step, so both are in the program.
_DECODE_CHUNK_BYTES = 8 * 1024 * 1024
_DECODE_CHUNK_TOKENS = (128, 512)
# Bytes of f32 scores one prefill chunk may produce for all T rows and heads, and the longest
# chunk.
_PREFILL_CHUNK_BYTES = 16 * 1024 * 1024
_PREFILL_CHUNK_TOKENS = 1024
_NEG = -1e30  # the running max before any key: finite, so exp(m - m_new) never sees inf - inf


def _pages(budget_bytes: int, per_token_bytes: int, max_tokens: int, page_size: int, cap: int):
    """Pages per chunk: as many as fit the byte budget and `max_tokens`, at least one, at most
    `cap`."""
    tokens = min(budget_bytes // max(per_token_bytes, 1), max_tokens)
    return int(max(1, min(tokens // page_size, cap)))


def _softmax_step(carry, s, v, mask):
    """One chunk of an online softmax. s: [..., C] scores, mask: broadcastable to s, v: values
    laid out for `pv`. Returns the new (m, l, acc) and the probabilities."""
    m, l, acc = carry
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + p.sum(axis=-1), alpha, p


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, K, page_size, 2H]
    layer: jax.Array | int,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: jax.Array,  # i32[]  keys a query sees back from itself; <= 0: all
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,  # f32[L, num_pages, 1, 2K * page_size]  8-bit only
    attend_to: jax.Array | None = None,  # i32[T]  see `ragged_paged_attention`
    sinks: jax.Array | None = None,  # f32[N]  see `ragged_paged_attention`
    attention_chunk: int | None = None,  # static  see `ragged_paged_attention`
) -> jax.Array:  # [T, N, H]
    """`attend_to` reaches only the prefill pass: a decode row's keys past itself would be
    other steps' (a one-token chunk's block is itself)."""
    cache = KVCache(kv_cache, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_size, _ = kv_cache.shape
    kh2 = 2 * num_kv_heads
    group = num_heads // num_kv_heads
    max_reqs, pages_per_seq = block_tables.shape
    f32 = jnp.float32

    r = jnp.arange(max_reqs, dtype=jnp.int32)
    real = r < num_seqs[0]
    q_lens = jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [R]
    seq = jnp.where(real, seq_lens, 0)  # [R]
    qf = q.astype(f32) * sm_scale

    def softcap(s):
        return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)

    def in_window(kv_pos, q_pos):
        """Within the sliding window and, with `attention_chunk`, the query's chunk."""
        seen = (sliding_window <= 0) | (kv_pos > q_pos - sliding_window)
        if attention_chunk is not None:
            seen &= kv_pos >= q_pos // attention_chunk * attention_chunk
        return seen

    def normalized(m, l, acc):
        """The online softmax's output, with the sinks folded in (`attention_sinks.py`)."""
        if sinks is not None:
            l, alpha = fold_sink(m, l, sinks.reshape(num_kv_heads, group))
            acc = alpha[..., None] * acc
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    def split_kv(kv, mask):
        """Gathered pages [..., C, 2K, H] -> zeroed where masked, then K and V [..., C, K, H]."""
        kv = jnp.where(mask[..., None, None], kv, 0.0)
        kv = kv.reshape(*kv.shape[:-2], num_kv_heads, 2, head_dim)
        return kv[..., 0, :], kv[..., 1, :]

    # ---- decode pass: one row per request with q_len == 1 ----------------------------------
    is_decode = q_lens == 1
    dec_len = jnp.where(is_decode, seq, 0)  # [R] keys each decode row sees
    dec_row = jnp.where(is_decode, cu_q_lens[:-1], num_tokens)  # [R] its row; T = none
    qd = qf[jnp.minimum(dec_row, num_tokens - 1)].reshape(max_reqs, num_kv_heads, group, -1)
    max_dec_len = jnp.max(dec_len)

    def decode_pass(cp: int):
        chunk = cp * page_size
        pad = -(-pages_per_seq // cp) * cp - pages_per_seq
        table = jnp.pad(block_tables, ((0, 0), (0, pad)))

        def body(c, carry):
            pages = jax.lax.dynamic_slice_in_dim(table, c * cp, cp, axis=1)  # [R, cp]
            kv = read_kv(cache, layer, pages).reshape(max_reqs, chunk, kh2, head_dim)
            kpos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
            mask = (kpos[None, :] < dec_len[:, None]) & in_window(
                kpos[None, :], dec_len[:, None] - 1
            )  # [R, C]
            k, v = split_kv(kv, mask)  # [R, C, K, H]
            s = softcap(jnp.einsum("rkgh,rckh->rkgc", qd, k))
            m, l, alpha, p = _softmax_step(carry, s, v, mask[:, None, None, :])
            acc = alpha[..., None] * carry[2] + jnp.einsum("rkgc,rckh->rkgh", p, v)
            return m, l, acc

        init = (
            jnp.full((max_reqs, num_kv_heads, group), _NEG, f32),
            jnp.zeros((max_reqs, num_kv_heads, group), f32),
            jnp.zeros((max_reqs, num_kv_heads, group, head_dim), f32),
        )
        num_chunks = (max_dec_len + chunk - 1) // chunk
        return normalized(*jax.lax.fori_loop(0, num_chunks, body, init))

    short, long = (
        _pages(_DECODE_CHUNK_BYTES, max_reqs * kh2 * head_dim * 4, n, page_size, pages_per_seq)
        for n in _DECODE_CHUNK_TOKENS
    )
    if short == long:
        out_dec = decode_pass(long)
    else:  # the short chunk while it takes at most two iterations
        out_dec = jax.lax.cond(
            max_dec_len <= 2 * short * page_size,
            lambda: decode_pass(short),
            lambda: decode_pass(long),
        )
    out_dec = out_dec.reshape(max_reqs, num_heads, head_dim)

    # ---- prefill pass: requests with several rows, their pages packed end to end ----------
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(
        jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32), max_reqs - 1
    )  # [T]
    is_prefill = q_lens > 1  # [R]
    row_on = is_prefill[req] & (t < cu_q_lens[num_seqs[0]])  # [T]
    pos = seq[req] - q_lens[req] + (t - cu_q_lens[req])  # [T]
    last = pos if attend_to is None else jnp.maximum(pos, attend_to)  # [T] the last key seen
    num_pages_r = jnp.where(is_prefill, (seq + page_size - 1) // page_size, 0)  # [R]
    page_end = jnp.cumsum(num_pages_r)  # [R] end of request r's pages in the stream
    page_start = page_end - num_pages_r
    cpp = _pages(
        _PREFILL_CHUNK_BYTES,
        num_tokens * num_heads * 4,
        _PREFILL_CHUNK_TOKENS,
        page_size,
        max_reqs * pages_per_seq,
    )
    pchunk = cpp * page_size
    qp = qf.reshape(num_tokens, num_kv_heads, group, head_dim)

    def prefill_body(c, carry):
        slot = c * cpp + jnp.arange(cpp, dtype=jnp.int32)  # [cpp] page slots of the stream
        sreq = jnp.minimum(
            jnp.searchsorted(page_end, slot, side="right").astype(jnp.int32), max_reqs - 1
        )
        in_req = slot - page_start[sreq]  # the page's index in its request
        live = slot < page_end[-1]
        page = block_tables[sreq, jnp.clip(in_req, 0, pages_per_seq - 1)]
        kv = read_kv(cache, layer, page).reshape(pchunk, kh2, head_dim)
        kreq = jnp.repeat(sreq, page_size)  # [C]
        kpos = (in_req[:, None] * page_size + jnp.arange(page_size)).reshape(-1)  # [C]
        kvalid = jnp.repeat(live, page_size) & (kpos < seq[kreq])
        k, v = split_kv(kv, kvalid)  # [C, K, H]
        mask = (
            (kreq[None, :] == req[:, None])
            & kvalid[None, :]
            & (kpos[None, :] <= last[:, None])
            & in_window(kpos[None, :], pos[:, None])
            & row_on[:, None]
        )  # [T, C]
        s = softcap(jnp.einsum("tkgh,ckh->tkgc", qp, k))
        m, l, alpha, p = _softmax_step(carry, s, v, mask[:, None, None, :])
        acc = alpha[..., None] * carry[2] + jnp.einsum("tkgc,ckh->tkgh", p, v)
        return m, l, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _NEG, f32),
        jnp.zeros((num_tokens, num_kv_heads, group), f32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), f32),
    )
    num_chunks = (page_end[-1] + cpp - 1) // cpp
    out = normalized(*jax.lax.fori_loop(0, num_chunks, prefill_body, init))
    out = out.reshape(num_tokens, num_heads, -1)

    # Decode rows got nothing from the prefill pass (l = 0 there): put their own results in.
    out = out.at[dec_row].set(out_dec, mode="drop")
    return out.astype(q.dtype)
