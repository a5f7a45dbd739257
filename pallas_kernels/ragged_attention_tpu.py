"""Ragged paged attention as a Mosaic TPU kernel.

The grid walks the flattened queries in blocks of `q_block` tokens. A block may hold rows of
several requests (a decode block holds one row per request); for each request that has rows in
the block, the kernel streams that request's KV pages from HBM in blocks of `kv_pages` pages,
double-buffered with async copies, and folds them into one online softmax per query row. Rows
of other requests are masked for that request, so every row ends up with exactly its own
request's attention.

Design choices that keep the kernel checkable on CPU (Pallas interpret mode and the TPU
simulator): every DMA copies one
whole page (fixed size; pages past a request's length are skipped with `pl.when` rather than
copied with a traced size) and VMEM refs are never reshaped after a DMA (only loaded values
are). Garbage in the cache can never leak in: scores outside the causal/sliding-window mask are
replaced, and value rows past the request's length are zeroed, before they are used.

The sliding window is a scalar-prefetch operand (SMEM), so it may be traced (a layer scan's
per-layer window). The wrapper turns it into a span, the number of keys a row sees back from
itself, `_NO_WINDOW` (more than any sequence) for full attention, so the kernel has one code
path: a row at position q sees keys q - span < k <= q, and each request's walk over its KV
blocks starts at the block holding its first row's first visible key, skipping the pages before
the window.

The queries are laid out head-major by the wrapper, `[K, T * G, H]` (G = query heads per kv
head), so each kv head's block is one plain `[rows, H] x [H, kv]` matmul with no reshape of a
ref inside the kernel.

An 8-bit cache's scales (`kv_cache.py`) come in a second HBM ref: each page's `[2K, page_size]`
of scales is copied with the page, under the same semaphore. The 8-bit block is widened to q's
dtype for the matmuls (int8 and e4m3 values are exact in bfloat16), and the scales multiply
the scores (K) and the probabilities (V) per key, a [1, kv] row each, rather than the blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache import widen_kv

# Scores outside the mask. Finite, so (masked - masked) is 0 and never NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The window span of full attention: longer than any sequence, and small enough that
# `position - span` cannot overflow i32.
_NO_WINDOW = 1 << 30


def _div(x, d: int):
    """x // d for x >= 0, as a truncating division: Mosaic lowers floor division of signed
    integers through `sign`, which needs a TPU to lower, so it would not lower here."""
    return jax.lax.div(x, jnp.int32(d))


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,  # i32[1]
    window_ref,  # i32[1]         window span: keys a row sees back from itself (>= 1)
    seq_lens_ref,  # i32[R]       tokens in the cache per request, this step's included
    tables_ref,  # i32[R * P]     block tables, flattened
    cu_q_lens_ref,  # i32[R + 1]
    req_lo_ref,  # i32[Q]         first request with rows in each q block
    req_end_ref,  # i32[Q]        one past the last such request
    # Blocks.
    q_ref,  # [K, bq * G, H]      this q block's queries, head-major
    kv_hbm_ref,  # [L, num_pages, page_size, 2K, H]  the whole cache, left in HBM
    *refs,
    q_block: int,
    group: int,
    kv_pages: int,
    pages_per_seq: int,
    sm_scale: float,
    soft_cap: float | None,
    quantized: bool,
):
    """`refs`, with an 8-bit cache: scales_hbm_ref f32[L, num_pages, 2K, page_size] (in HBM),
    then always: o_ref [K, bq * G, H]; scratch kv_buf [2, kv_pages, page_size, 2K, H] (double
    buffer), with an 8-bit cache scale_buf f32[2, kv_pages, 2K, page_size], sems (DMA
    semaphores [2], one per buffer slot), m_ref, l_ref f32[K, bq * G, 1] (running max and sum)
    and acc_ref f32[K, bq * G, H] (running numerator)."""
    if quantized:
        scales_hbm_ref, o_ref, kv_buf, scale_buf, sems, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, kv_buf, sems, m_ref, l_ref, acc_ref = refs
        scales_hbm_ref = scale_buf = None
    num_kv_heads, rows, _ = q_ref.shape
    page_size = kv_buf.shape[2]
    kv_tokens = kv_pages * page_size
    b = pl.program_id(0)
    block_start = b * q_block
    block_end = block_start + q_block
    layer, window = layer_ref[0], window_ref[0]

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def request_span(r):
        """(q_start, q_end, seq_len, kv_begin, kv_end) of request r's rows in this block."""
        q_start, q_end, seq_len = cu_q_lens_ref[r], cu_q_lens_ref[r + 1], seq_lens_ref[r]
        first_pos = seq_len - (q_end - q_start) + (jnp.maximum(q_start, block_start) - q_start)
        kv_end = seq_len - (q_end - jnp.minimum(q_end, block_end))  # last row's position + 1
        kv_begin = jnp.maximum(first_pos - window + 1, 0)
        return q_start, q_end, seq_len, kv_begin, kv_end

    def kv_block_range(r):
        *_, kv_begin, kv_end = request_span(r)
        return _div(kv_begin, kv_tokens), _div(kv_end + kv_tokens - 1, kv_tokens)

    def page_copies(r, kb, slot):
        """The DMAs of kv block kb of request r, each paired with whether it is needed."""
        kv_end = request_span(r)[4]
        for i in range(kv_pages):
            p = kb * kv_pages + i
            page = tables_ref[r * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            needed = p * page_size < kv_end
            yield (
                needed,
                pltpu.make_async_copy(
                    kv_hbm_ref.at[layer, page], kv_buf.at[slot, i], sems.at[slot]
                ),
            )
            if quantized:
                yield (
                    needed,
                    pltpu.make_async_copy(
                        scales_hbm_ref.at[layer, page], scale_buf.at[slot, i], sems.at[slot]
                    ),
                )

    def start_fetch(r, kb, slot):
        for needed, copy in page_copies(r, kb, slot):
            pl.when(needed)(copy.start)

    def wait_fetch(r, kb, slot):
        for needed, copy in page_copies(r, kb, slot):
            pl.when(needed)(copy.wait)

    def compute(r, kb, slot):
        q_start, q_end, seq_len, kv_begin, kv_end = request_span(r)
        row_tok = block_start + _div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
        row_pos = seq_len - (q_end - q_start) + (row_tok - q_start)  # [rows, 1]
        kv_pos = kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, kv_tokens), 1)
        mask = (row_tok >= q_start) & (row_tok < q_end) & (kv_pos <= row_pos)
        mask &= kv_pos > row_pos - window
        # Value rows past the request's data may hold anything (stale or never written).
        v_ok = (kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (kv_tokens, 1), 0)) < kv_end
        kv = kv_buf[slot]  # [kv_pages, page_size, 2K, H]
        # The dtype the matmuls take: the cache's, or q's when the cache is 8-bit (int8 and
        # e4m3 values are exact in bfloat16); the scales are applied to scores and
        # probabilities, per key, rather than to the [kv, H] blocks.
        dtype = q_ref.dtype if quantized else kv.dtype  # (fp8 is stored as its bytes)
        if quantized:
            ok = kv_pos < kv_end  # [1, kv]
            scales = scale_buf[slot]  # [kv_pages, 2K, page_size]
        for h in range(num_kv_heads):
            q = q_ref[h].astype(dtype)  # [rows, H]
            k = widen_kv(kv[:, :, 2 * h, :].reshape(kv_tokens, -1), dtype)  # [kv, H]
            v = widen_kv(kv[:, :, 2 * h + 1, :].reshape(kv_tokens, -1), dtype)  # [kv, H]
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )  # [rows, kv]
            if quantized:
                k_scale = jnp.where(ok, scales[:, 2 * h, :].reshape(1, kv_tokens), 0.0)
                v_scale = jnp.where(ok, scales[:, 2 * h + 1, :].reshape(1, kv_tokens), 0.0)
                s = s * k_scale
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, _MASK_VALUE)
            m_prev = m_ref[h]  # [rows, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            m_ref[h] = m_new
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=-1, keepdims=True)
            if quantized:
                p = p * v_scale
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv

    req_lo, req_end = req_lo_ref[b], req_end_ref[b]

    @pl.when(req_lo < req_end)
    def _():
        start_fetch(req_lo, kv_block_range(req_lo)[0], 0)

        def request_body(r, step):
            kb_lo, kb_hi = kv_block_range(r)

            def kv_body(kb, step):
                slot = jax.lax.rem(step, 2)
                # Prefetch the next block (of this request, or else the next request's first)
                # into the other slot before computing on this one.
                more_here = kb + 1 < kb_hi
                next_r = jnp.where(more_here, r, jnp.minimum(r + 1, req_end - 1))
                next_kb = jnp.where(more_here, kb + 1, kv_block_range(next_r)[0])

                @pl.when(more_here | (r + 1 < req_end))
                def _():
                    start_fetch(next_r, next_kb, 1 - slot)

                wait_fetch(r, kb, slot)
                compute(r, kb, slot)
                return step + 1

            return jax.lax.fori_loop(kb_lo, kb_hi, kv_body, step)

        jax.lax.fori_loop(req_lo, req_end, request_body, 0)

    l = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
    layer: jax.Array | int,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: jax.Array,  # i32[]  keys a query sees back from itself; <= 0: all
    soft_cap: float | None = None,
    q_block: int,
    kv_pages: int,
    kv_scales: jax.Array | None = None,  # f32[L, num_pages, 2K, page_size]  8-bit cache only
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, N, H]
    """The Mosaic TPU kernel behind `ragged_paged_attention(..., backend="pallas_tpu")`.

    Shapes are checked by the public entry point; `q_block` (query tokens per grid step) and
    `kv_pages` (pages per KV block) come from `tuning.get_block_sizes`.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, kh2, _ = kv_cache.shape
    num_kv_heads = kh2 // 2
    group = num_heads // num_kv_heads
    max_reqs, pages_per_seq = block_tables.shape
    kv_pages = max(1, min(kv_pages, pages_per_seq))
    q_block = max(1, min(q_block, num_tokens))
    num_q_blocks = pl.cdiv(num_tokens, q_block)
    padded_tokens = num_q_blocks * q_block

    # Head-major queries: [T, N, H] -> [K, T * G, H]; row t * G + g is token t, head k * G + g.
    qh = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    qh = qh.reshape(padded_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qh = qh.reshape(num_kv_heads, padded_tokens * group, head_dim)

    # Which requests have rows in each q block: [req_lo, req_end).
    n = num_seqs[0]
    starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * q_block
    req_lo = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], starts, side="right"), n)
    req_end = jnp.minimum(jnp.searchsorted(cu_q_lens[:-1], starts + q_block, side="left"), n)
    window = jnp.asarray(sliding_window, jnp.int32)
    span = jnp.where(window > 0, jnp.minimum(window, _NO_WINDOW), _NO_WINDOW)

    rows = q_block * group
    kernel = functools.partial(
        _kernel,
        q_block=q_block,
        group=group,
        kv_pages=kv_pages,
        pages_per_seq=pages_per_seq,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        quantized=kv_scales is not None,
    )
    q_spec = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda b, *_: (0, b, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM((2, kv_pages, page_size, kh2, head_dim), kv_cache.dtype)
    if kv_scales is None:
        extra_in, extra_args, buffers = [], [], [kv_buf]
    else:
        scale_buf = pltpu.VMEM((2, kv_pages, kh2, page_size), jnp.float32)
        extra_in, extra_args, buffers = [hbm], [kv_scales], [kv_buf, scale_buf]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(num_q_blocks,),
            in_specs=[q_spec, hbm, *extra_in],
            out_specs=q_spec,
            scratch_shapes=[
                *buffers,
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        span.reshape(1),
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        req_lo.astype(jnp.int32),
        req_end.astype(jnp.int32),
        qh,
        kv_cache,
        *extra_args,
    )
    out = out.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded_tokens, num_heads, head_dim)[:num_tokens]
