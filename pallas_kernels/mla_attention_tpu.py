"""Multi-head latent attention (`mla_attention.py`) as a Mosaic TPU kernel: the same absorbed
form over the same paired cache, on the GQA kernel's skeleton (`ragged_attention_tpu.py`).

Work items are that kernel's: each request's queries cut into blocks of `q_block` tokens, one
grid step per block, run in order ("arbitrary"). A work item's rows are its tokens times all
of the device's heads (row i * N + h: token i, head h), so the latent rows, which every head
shares, stream through VMEM once per item for all heads: a decode of one request at V3's 128
heads reads each cached row once, where expanded attention would read 128 keys and values.

KV streaming is the GQA kernel's too: the request's pages in blocks of `kv_pages`, double
buffered across grid steps by one DMA per page (its `[page_size / 2, lanes]` pair rows, whole
tiles), the page ids fetched from the block tables in HBM by 128-entry chunks into SMEM, and
pages past a request's length never copied.

A KV block is `[kv / 2, lanes]` pair rows (`mla_attention.py`): lanes `[0, L)` the even
tokens' latents, `[L, 2L)` the odd ones', `[2L, 2L + 2R)` both RoPE keys. For V3 (L 512, R 64)
every part starts on a 128-lane tile, so the kernel slices it without relayout and no lane is
padding. Even and odd tokens are scored as two halves of the block:

    s_even = ql . c_even^T + [q_pe | 0] . pe^T        s_odd = ql . c_odd^T + [0 | q_pe] . pe^T

(the RoPE query padded by the wrapper, so the RoPE keys need no 64-lane slice), both halves
folded into one online softmax, and `acc += p_even c_even + p_odd c_odd`. The softmax does not
care about the keys' order, so no interleaving is ever needed.

An 8-bit cache's one scale per row comes with its page (its scales row, copied under the same
semaphore) and multiplies the scores and the probabilities per key, as in the GQA kernel,
the data widened to the queries' dtype for the dots (int8 and e4m3 are exact in bfloat16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache import widen_kv
from pallas_kernels.ragged_attention_tpu import (
    _MASK_VALUE,
    _TABLE_CHUNK,
    PageStream,
    _div,
    _work_items,
    kv_block_pages,
)


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,  # i32[1]
    seq_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S + 1]
    work_req_ref,  # i32[W]  request of each work item, -1 past the last
    work_tok_ref,  # i32[W]  its first query token
    # Blocks.
    ql_ref,  # [1, rows, L]        this work item's latent queries, row i * N + h
    qpe_ref,  # [1, 2, rows, 2R]   its RoPE queries as [q_pe | 0] and [0 | q_pe]
    tables_hbm_ref,  # i32[1, S * P']  block tables, rows padded to whole chunks
    kv_hbm_ref,  # [layers, num_pages, 1, page_size / 2, lanes]  left in HBM
    *refs,
    q_block: int,
    num_heads: int,
    kv_pages: int,
    table_chunk: int,
    padded_pages: int,
    num_work: int,
    sm_scale: float,
    latent: int,
    rope: int,
    quantized: bool,
):
    """`refs`: with an 8-bit cache first scales_hbm_ref f32[layers, num_pages, 1, >= page_size]
    (HBM); then o_ref f32[1, rows, L]; scratch kv_buf [2, kv_pages, page_size / 2, lanes],
    with an 8-bit cache scale_buf f32[2, kv_pages, 1, >= page_size], the page-id chunk tbuf
    (SMEM), the step counter step_ref (SMEM), DMA semaphores sems [2] and tsem [1], and
    m_ref, l_ref f32[rows, 1], acc_ref f32[rows, L]."""
    if quantized:
        scales_hbm_ref, o_ref, kv_buf, scale_buf, tbuf, step_ref, sems, tsem, *acc = refs
    else:
        o_ref, kv_buf, tbuf, step_ref, sems, tsem, *acc = refs
        scales_hbm_ref = scale_buf = None
    m_ref, l_ref, acc_ref = acc
    rows = ql_ref.shape[1]
    pairs, lanes = kv_buf.shape[2], kv_buf.shape[3]
    page_size = 2 * pairs
    kv_tokens = kv_pages * page_size
    half = kv_pages * pairs  # pair rows in a KV block
    j = pl.program_id(0)
    layer = layer_ref[0]

    def item_span(w):
        """(request, q_end, seq_len, first token, kv_end) of work item w: its rows are tokens
        [first, min(first + q_block, q_end)) of the request, which see keys [0, kv_end)."""
        r = jnp.maximum(work_req_ref[w], 0)
        q_end, seq_len, tok0 = cu_q_lens_ref[r + 1], seq_lens_ref[r], work_tok_ref[w]
        kv_end = seq_len - (q_end - jnp.minimum(q_end, tok0 + q_block))  # last row's pos + 1
        return r, q_end, seq_len, tok0, kv_end

    def num_blocks(w):
        return _div(item_span(w)[4] + kv_tokens - 1, kv_tokens)

    stream = PageStream(
        kv_page=lambda page: kv_hbm_ref.at[layer, page, 0],
        kv_buf=kv_buf,
        scale_page=None if not quantized else (lambda page: scales_hbm_ref.at[layer, page]),
        scale_buf=scale_buf,
        sems=sems,
        tables_hbm_ref=tables_hbm_ref,
        tbuf=tbuf,
        tsem=tsem,
        kv_pages=kv_pages,
        page_size=page_size,
        table_chunk=table_chunk,
        padded_pages=padded_pages,
    )

    def start_fetch(w, kb, slot):
        r, *_, kv_end = item_span(w)
        stream.start(r, kv_end, kb, slot)

    def wait_fetch(w, kb, slot):
        stream.wait(item_span(w)[4], kb, slot)

    def parity_row(x, parity: int):
        """The scales of the block's even (`parity` 0) or odd tokens as one f32[1, kv / 2] row
        (pair row j's at lane j), from `x` f32[kv_pages, page_size] (a page's tokens' scales
        in lanes): a 0/1 matmul at full precision, exact (Mosaic has no sublane-to-lane
        reshape)."""
        col = jax.lax.broadcasted_iota(jnp.int32, (page_size, half), 1)
        pick = jax.lax.broadcasted_iota(jnp.int32, (page_size, half), 0) == (
            2 * jax.lax.rem(col, pairs) + parity
        )
        wide = jnp.dot(
            x,
            pick.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # [kv_pages, kv / 2]: page i's scales in every page's lanes
        own = jax.lax.broadcasted_iota(jnp.int32, (kv_pages, half), 0) == _div(
            jax.lax.broadcasted_iota(jnp.int32, (kv_pages, half), 1), pairs
        )
        return jnp.where(own, wide, 0.0).sum(axis=0, keepdims=True)

    def compute(w, kb, slot):
        _, q_end, seq_len, tok0, kv_end = item_span(w)
        row_tok = tok0 + _div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), num_heads)
        row_pos = seq_len - (q_end - row_tok)  # [rows, 1]
        row_ok = row_tok < q_end
        even = kb * kv_tokens + 2 * jax.lax.broadcasted_iota(jnp.int32, (1, half), 1)
        even_col = kb * kv_tokens + 2 * jax.lax.broadcasted_iota(jnp.int32, (half, 1), 0)
        dtype = ql_ref.dtype if quantized else kv_buf.dtype
        x = widen_kv(kv_buf[slot].reshape(half, lanes), dtype)  # [kv / 2, lanes]
        # Rows past the request's data may hold anything (stale, never written, or a page
        # not copied): zeroed, as the other parity's query lanes multiply them by 0.
        pe = x[:, 2 * latent : 2 * (latent + rope)]  # [kv / 2, 2R]
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, 2 * rope), 1)
        pe_ok = even_col + jnp.where(lane < rope, 0, 1) < kv_end
        pe = jnp.where(pe_ok, pe, jnp.zeros_like(pe))
        ql = ql_ref[0].astype(dtype)
        if quantized:
            # Slots past the request's data, and pages that were not copied, hold anything:
            # zero their scales before the matmul that spreads them.
            shape = (kv_pages, page_size)
            slot_pos = (
                kb * kv_tokens
                + page_size * jax.lax.broadcasted_iota(jnp.int32, shape, 0)
                + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            )
            scales = scale_buf[slot, :, 0, :][:, :page_size]
            scales = jnp.where(slot_pos < kv_end, scales, 0.0)
        m_prev = m_ref[...]
        parts = []
        for parity in (0, 1):
            pos, pos_col = even + parity, even_col + parity
            c = x[:, parity * latent : (parity + 1) * latent]
            c = jnp.where(pos_col < kv_end, c, jnp.zeros_like(c))
            dims = (((1,), (1,)), ((), ()))
            s = jax.lax.dot_general(ql, c, dims, preferred_element_type=jnp.float32)
            s += jax.lax.dot_general(
                qpe_ref[0, parity].astype(dtype), pe, dims, preferred_element_type=jnp.float32
            )  # [rows, kv / 2]
            scale = parity_row(scales, parity) if quantized else None
            if quantized:
                s = s * scale
            mask = row_ok & (pos <= row_pos)
            parts.append((jnp.where(mask, s * sm_scale, _MASK_VALUE), mask, c, scale))
        m_new = m_prev
        for s, *_ in parts:
            m_new = jnp.maximum(m_new, s.max(axis=-1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        l, acc = alpha * l_ref[...], alpha * acc_ref[...]
        for s, mask, c, scale in parts:
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            l += p.sum(axis=-1, keepdims=True)
            if quantized:
                p = p * scale
            acc += jnp.dot(p.astype(c.dtype), c, preferred_element_type=jnp.float32)
        m_ref[...], l_ref[...], acc_ref[...] = m_new, l, acc

    @pl.when(j == 0)
    def _():
        step_ref[0] = 0

    active = work_req_ref[j] >= 0

    @pl.when(active)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        kb_hi = num_blocks(j)

        @pl.when(j == 0)  # later work items find their first block already on its way
        def _():
            start_fetch(j, 0, 0)

        nxt = jnp.minimum(j + 1, num_work - 1)
        next_active = (j + 1 < num_work) & (work_req_ref[nxt] >= 0)

        def kv_body(kb, _):
            slot = jax.lax.rem(step_ref[0], 2)
            more_here = kb + 1 < kb_hi
            next_w = jnp.where(more_here, j, nxt)
            next_kb = jnp.where(more_here, kb + 1, 0)

            @pl.when(more_here | next_active)
            def _():
                start_fetch(next_w, next_kb, 1 - slot)

            wait_fetch(j, kb, slot)
            compute(j, kb, slot)
            step_ref[0] = step_ref[0] + 1
            return 0

        jax.lax.fori_loop(0, kb_hi, kv_body, 0)
        l = l_ref[...]
        o_ref[0] = acc_ref[...] / jnp.where(l > 0.0, l, 1.0)

    @pl.when(jnp.logical_not(active))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def mla_paged_attention_tpu(
    ql: jax.Array,  # [T, N, L]
    q_pe: jax.Array,  # [T, N, R]
    kv_cache: jax.Array,  # [layers, num_pages, 1, page_size / 2, lanes] (a KVCache's data)
    layer: jax.Array | int,
    seq_lens: jax.Array,  # i32[S]
    block_tables: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    kv_scales: jax.Array | None = None,  # 8-bit caches only
    kv_tokens: int = 512,
    max_rows: int = 512,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # f32[T, N, L]
    """The Mosaic kernel behind `mla_paged_attention(..., backend="pallas_tpu")`: KV blocks of
    about `kv_tokens` tokens (whole pages, a power of two of them, capped to fit VMEM), and
    work items of at most `max_rows` rows (query tokens x heads) in a step with more tokens
    than requests; one token each in a step that may be all decodes. (Reasoned starting
    points, not measured on a TPU.)"""
    num_tokens, num_heads, latent = ql.shape
    rope = q_pe.shape[-1]
    _, num_pages, _, pairs, lanes = kv_cache.shape
    page_size = 2 * pairs
    max_reqs, pages_per_seq = block_tables.shape
    itemsize = kv_cache.dtype.itemsize
    kv_pages = kv_block_pages(
        min(max(1, kv_tokens // page_size), pages_per_seq), 1, pairs, lanes // 2, itemsize
    )
    q_block = 1
    if num_tokens > max_reqs:  # some request has several queries
        q_block = max(1, min(max_rows // num_heads, num_tokens))
        q_block = 1 << (q_block.bit_length() - 1)
    rows = q_block * num_heads

    work_req, work_tok, num_work, t_row, t_valid = _work_items(
        cu_q_lens, num_seqs, max_reqs, num_tokens, q_block
    )
    src = jnp.minimum(work_tok[:, None] + jnp.arange(q_block, dtype=jnp.int32), num_tokens - 1)
    src = src.reshape(-1)
    qw = ql[src].reshape(num_work, rows, latent)
    zeros = jnp.zeros_like(q_pe)
    pe = jnp.stack(
        [jnp.concatenate([q_pe, zeros], axis=-1), jnp.concatenate([zeros, q_pe], axis=-1)]
    )  # [2, T, N, 2R]
    pe = pe[:, src].reshape(2, num_work, rows, 2 * rope).transpose(1, 0, 2, 3)

    table_chunk = max(_TABLE_CHUNK, kv_pages)
    padded_pages = -(-pages_per_seq // table_chunk) * table_chunk
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))
    tables = jnp.clip(tables, 0, num_pages - 1).reshape(1, -1)

    kernel = functools.partial(
        _kernel,
        q_block=q_block,
        num_heads=num_heads,
        kv_pages=kv_pages,
        table_chunk=table_chunk,
        padded_pages=padded_pages,
        num_work=num_work,
        sm_scale=sm_scale,
        latent=latent,
        rope=rope,
        quantized=kv_scales is not None,
    )
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM((2, kv_pages, pairs, lanes), kv_cache.dtype)
    if kv_scales is None:
        extra_in, extra_args, buffers = [], [], [kv_buf]
    else:
        scale_buf = pltpu.VMEM((2, kv_pages, *kv_scales.shape[2:]), jnp.float32)
        extra_in, extra_args, buffers = [hbm], [kv_scales], [kv_buf, scale_buf]
    out_spec = pl.BlockSpec((1, rows, latent), lambda w, *_: (w, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_work,),
            in_specs=[
                out_spec,
                pl.BlockSpec((1, 2, rows, 2 * rope), lambda w, *_: (w, 0, 0, 0)),
                hbm,
                hbm,
                *extra_in,
            ],
            out_specs=out_spec,
            scratch_shapes=[
                *buffers,
                pltpu.SMEM((table_chunk,), jnp.int32),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((1,)),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, latent), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_work, rows, latent), jnp.float32),
        # Sequential: a grid step starts the next one's first KV block.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=64 * 2**20
        ),
        interpret=interpret,
        cost_estimate=_cost(ql, q_pe, kv_cache, block_tables, kv_scales),
        name="mla_paged_attention_tpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        seq_lens.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        work_req,
        work_tok,
        qw,
        pe,
        tables,
        kv_cache,
        *extra_args,
    )
    out = out.reshape(num_work * q_block, num_heads, latent)[t_row]
    return jnp.where(t_valid[:, None, None], out, 0.0)


def latent_attention_cost(
    num_tokens: int,
    num_heads: int,
    latent: int,
    rope: int,
    q_itemsize: int,
    cache_shape: tuple[int, ...],
    cache_itemsize: int,
    block_tables_shape: tuple[int, int],
    quantized: bool,
) -> tuple[int, int, int, int]:
    """(flops, transcendentals, bytes accessed, of which the queries' and outputs' bytes) of
    one latent attention call over one layer, as the kernel declares it to its compiler: an
    upper bound, as `kv_cache.attention_cost` is for the GQA kernels (every request that can
    have a query at its block table's full reach, capped by the pool). A query head and a key
    cost 2(L + R) flops to score and 2L to weigh."""
    _, num_pages, _, pairs, lanes = cache_shape
    max_reqs, pages_per_seq = block_tables_shape
    pages = min(min(num_tokens, max_reqs) * pages_per_seq, num_pages)
    page_bytes = pairs * lanes * cache_itemsize + (2 * pairs * 4 if quantized else 0)
    keys = min(pages_per_seq, num_pages) * 2 * pairs
    scored = num_tokens * num_heads * keys
    io = num_tokens * num_heads * ((latent + rope) * q_itemsize + latent * 4)
    return 2 * (2 * latent + rope) * scored, scored, pages * page_bytes + io, io


def _cost(ql, q_pe, kv_cache, block_tables, kv_scales) -> pl.CostEstimate:
    flops, transcendentals, nbytes, _ = latent_attention_cost(
        *ql.shape, q_pe.shape[-1], ql.dtype.itemsize, kv_cache.shape, kv_cache.dtype.itemsize,
        block_tables.shape, kv_scales is not None,
    )  # fmt: skip
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=nbytes)
