"""Ragged paged attention as a Mosaic TPU kernel.

Work items. The wrapper cuts each request's queries into blocks of `q_block` tokens; one grid
step serves one block of one request (a decode row is a block of its own), so no row is scored
against another request's keys. A decode batch of B sequences is B grid steps, each streaming
one sequence's pages once. Grid steps past the last block do nothing. The queries are gathered
into that per-block layout, head-major, `[W, K, q_block * G, H]` (W blocks, G query heads per kv
head), so each kv head's block is one plain `[rows, H] x [H, kv]` matmul, and the block's
queries and outputs move through Pallas' own pipeline.

KV streaming. For its block, a grid step walks the request's KV in blocks of `kv_pages` pages,
double-buffered with async copies: while block n is computed, block n + 1 (of this work item,
or the next work item's first) is already on its way, so the grid runs sequentially
("arbitrary") and the buffers, semaphores and a step counter live across grid steps. Every DMA
copies one whole page of all the device's kv heads (`[K, page_size, 2H]`, fixed size; a
loop starts one per page the block needs, so pages past a request's length are never copied,
and no DMA has a traced size) and VMEM
refs are never reshaped after a DMA (only loaded values are), which keeps the kernel runnable
in Pallas' interpret mode and the TPU simulator on a CPU.

Block tables stay in HBM. Prefetching them whole into scalar memory (SMEM, 1 MiB) overflowed at
64 sequences of 128k tokens (8,192 pages each); each KV block's page ids come instead as a
128-entry chunk of the flattened tables, DMA'd into SMEM just before the block's pages are
requested (while the previous block's pages are still in flight, so the wait is hidden).

The sliding window is a scalar-prefetch operand (SMEM), so it may be traced (a layer scan's
per-layer window). The wrapper turns it into a span, the number of keys a row sees back from
itself, `_NO_WINDOW` (more than any sequence) for full attention, so the kernel has one code
path: a row at position q sees keys q - span < k <= q, and each work item's walk over its KV
blocks starts at the block holding its first row's first visible key. Garbage in the cache can
never leak in: scores outside the causal/window mask are replaced, and value rows past the
request's length are zeroed, before they are used.

An 8-bit cache's scales (`kv_cache.py`, one lane-dense row of `2K * page_size` per page) come in
a second HBM ref: each page's row is copied with the page, under the same semaphore. The 8-bit
block is widened to q's dtype for the matmuls (int8 and e4m3 values are exact in bfloat16), and
the scales multiply the scores (K) and the probabilities (V) per key, as `[1, kv]` rows. A
`[kv_pages, page_size]` block of scales becomes that row through a small exact matmul with a 0/1
matrix (Mosaic has no sublane-to-lane reshape).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention_sinks import fold_sink
from pallas_kernels.kv_cache import attention_cost, widen_kv

# Scores outside the mask. Finite, so (masked - masked) is 0 and never NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The window span of full attention: longer than any sequence, and small enough that
# `position - span` cannot overflow i32.
_NO_WINDOW = 1 << 30
# Page ids per block-table DMA: HBM tiles the table's lanes by 128, and a DMA starts on a tile.
_TABLE_CHUNK = 128
# VMEM for the double-buffered KV blocks; larger kv heads x head sizes get shorter blocks.
_KV_BUFFER_BYTES = 8 * 2**20


def _div(x, d: int):
    """x // d for x >= 0, as a truncating division: Mosaic lowers floor division of signed
    integers through `sign`, which needs a TPU to lower, so it would not lower here."""
    return jax.lax.div(x, jnp.int32(d))


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,  # i32[1]
    window_ref,  # i32[1]         window span: keys a row sees back from itself (>= 1)
    seq_lens_ref,  # i32[R]       tokens in the cache per request, this step's included
    cu_q_lens_ref,  # i32[R + 1]
    work_req_ref,  # i32[W]       request of each work item, -1 past the last
    work_tok_ref,  # i32[W]       its first query token
    # Blocks.
    q_ref,  # [1, K, bq * G, H]   this work item's queries, head-major
    tables_hbm_ref,  # i32[1, R * P']  block tables, rows padded to P' (whole chunks)
    kv_hbm_ref,  # [L, num_pages, K, page_size, 2H]  the whole cache, left in HBM
    *refs,
    q_block: int,
    group: int,
    kv_pages: int,
    table_chunk: int,
    padded_pages: int,
    num_work: int,
    sm_scale: float,
    soft_cap: float | None,
    quantized: bool,
    attend_refs: tuple | None = None,
    sinks: bool = False,
    attention_chunk: int | None = None,
):
    """`attend_refs`: with `attend_to`, (work_end_ref i32[W] in SMEM: the key each work item
    sees up to, exclusive; last_ref [1, bq * G, 1] i32: the last key each of its rows sees),
    see `_attend_kernel`. `refs`, with `sinks`: first sink_ref f32[K, bq * G, 1] (each row's
    head's sink logit); with an 8-bit cache: scales_hbm_ref f32[L, num_pages, 1, 2K * page_size] (in
    HBM), then always: o_ref [1, K, bq * G, H]; scratch kv_buf [2, kv_pages, K, page_size, 2H]
    (double buffer), with an 8-bit cache scale_buf f32[2, kv_pages, 1, 2K * page_size], the
    page-id chunk tbuf i32[table_chunk] (SMEM), the step counter step_ref i32[1] (SMEM: KV blocks
    computed so far, whose parity picks the buffer slot), sems (DMA semaphores [2], one per
    slot), tsem (DMA semaphore [1], the table chunk), m_ref, l_ref f32[K, rows, 1] (running max
    and sum) and acc_ref f32[K, rows, H] (running numerator)."""
    sink_ref = refs[0] if sinks else None
    refs = refs[1:] if sinks else refs
    if quantized:
        scales_hbm_ref, o_ref, kv_buf, scale_buf, tbuf, step_ref, sems, tsem, *acc = refs
    else:
        o_ref, kv_buf, tbuf, step_ref, sems, tsem, *acc = refs
        scales_hbm_ref = scale_buf = None
    m_ref, l_ref, acc_ref = acc
    _, num_kv_heads, rows, head_dim = q_ref.shape
    page_size = kv_buf.shape[3]
    kv_tokens = kv_pages * page_size
    j = pl.program_id(0)
    layer, window = layer_ref[0], window_ref[0]

    def item_span(w):
        """(request, q_start, q_end, seq_len, first_tok, kv_begin, kv_end) of work item w:
        its rows are tokens [first_tok, min(first_tok + bq, q_end)) of request r, and they see
        keys [kv_begin, kv_end)."""
        r = jnp.maximum(work_req_ref[w], 0)
        q_start, q_end, seq_len = cu_q_lens_ref[r], cu_q_lens_ref[r + 1], seq_lens_ref[r]
        tok0 = work_tok_ref[w]
        first_pos = seq_len - (q_end - tok0)
        kv_end = seq_len - (q_end - jnp.minimum(q_end, tok0 + q_block))  # last row's pos + 1
        if attend_refs is not None:  # rows that see this step's keys past themselves
            kv_end = jnp.maximum(kv_end, attend_refs[0][w])
        kv_begin = jnp.maximum(first_pos - window + 1, 0)
        if attention_chunk is not None:  # the first row's chunk starts first
            kv_begin = jnp.maximum(kv_begin, _div(first_pos, attention_chunk) * attention_chunk)
        return r, q_start, q_end, seq_len, tok0, kv_begin, kv_end

    def kv_block_range(w):
        *_, kv_begin, kv_end = item_span(w)
        return _div(kv_begin, kv_tokens), _div(kv_end + kv_tokens - 1, kv_tokens)

    stream = PageStream(
        kv_page=lambda page: kv_hbm_ref.at[layer, page],
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
        """Brings the page ids of block kb of work item w into SMEM, then starts its DMAs."""
        r, *_, kv_end = item_span(w)
        stream.start(r, kv_end, kb, slot)

    def wait_fetch(w, kb, slot):
        stream.wait(item_span(w)[6], kb, slot)

    def flatten(x, s_lo):
        """Lanes [s_lo, s_lo + page_size) of each page's row of `x` f32[kv_pages, n], as one
        f32[1, kv_tokens] row (page i's at lanes [i * page_size, (i + 1) * page_size)): a 0/1
        matmul at full precision, exact."""
        part = x[:, s_lo : s_lo + page_size]  # [kv_pages, page_size]
        col = jax.lax.broadcasted_iota(jnp.int32, (page_size, kv_tokens), 1)
        spread = jax.lax.broadcasted_iota(jnp.int32, (page_size, kv_tokens), 0) == col % page_size
        wide = jnp.dot(
            part,
            spread.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # [kv_pages, kv]: page i's scales repeated in every page's lanes
        own = jax.lax.broadcasted_iota(jnp.int32, (kv_pages, kv_tokens), 0) == _div(
            jax.lax.broadcasted_iota(jnp.int32, (kv_pages, kv_tokens), 1), page_size
        )
        return jnp.where(own, wide, 0.0).sum(axis=0, keepdims=True)

    def compute(w, kb, slot):
        _, q_start, q_end, seq_len, tok0, _, kv_end = item_span(w)
        row_tok = tok0 + _div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
        row_pos = seq_len - (q_end - row_tok)  # [rows, 1]
        kv_pos = kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, kv_tokens), 1)
        row_last = row_pos if attend_refs is None else attend_refs[1][0]  # [rows, 1]
        mask = (row_tok < q_end) & (kv_pos <= row_last) & (kv_pos > row_pos - window)
        if attention_chunk is not None:  # each row's own chunk
            mask &= kv_pos >= _div(row_pos, attention_chunk) * attention_chunk
        # Value rows past the request's data may hold anything (stale, or never written).
        v_ok = (kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (kv_tokens, 1), 0)) < kv_end
        # The dtype the matmuls take: the cache's, or q's when the cache is 8-bit (int8 and
        # e4m3 values are exact in bfloat16); the scales are applied to scores and
        # probabilities, per key, rather than to the [kv, H] blocks.
        dtype = q_ref.dtype if quantized else kv_buf.dtype
        if quantized:
            # Slots past the request's data, and pages that were not copied, hold anything:
            # zero their scales before the matmul that spreads them.
            shape = (kv_pages, scale_buf.shape[-1])  # 2K * page_size, or padded lanes
            slot_pos = (
                kb * kv_tokens
                + page_size * jax.lax.broadcasted_iota(jnp.int32, shape, 0)
                + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, shape, 1), page_size)
            )
            scales = jnp.where(slot_pos < kv_end, scale_buf[slot, :, 0, :], 0.0)
        for h in range(num_kv_heads):
            q = q_ref[0, h].astype(dtype)  # [rows, H]
            x = kv_buf[slot, :, h].reshape(kv_tokens, 2 * head_dim)  # [kv, 2H]
            k = widen_kv(x[:, :head_dim], dtype)  # [kv, H]
            v = widen_kv(x[:, head_dim:], dtype)  # [kv, H]
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )  # [rows, kv]
            if quantized:
                s = s * flatten(scales, 2 * h * page_size)
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
                p = p * flatten(scales, (2 * h + 1) * page_size)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv

    @pl.when(j == 0)
    def _():
        step_ref[0] = 0

    active = work_req_ref[j] >= 0

    @pl.when(active)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        kb_lo, kb_hi = kv_block_range(j)

        @pl.when(j == 0)  # later work items find their first block already on its way
        def _():
            start_fetch(j, kb_lo, 0)

        nxt = jnp.minimum(j + 1, num_work - 1)
        next_active = (j + 1 < num_work) & (work_req_ref[nxt] >= 0)

        def kv_body(kb, _):
            slot = jax.lax.rem(step_ref[0], 2)
            # Start the next block (of this work item, or the next one's first) into the other
            # slot before computing on this one.
            more_here = kb + 1 < kb_hi
            next_w = jnp.where(more_here, j, nxt)
            next_kb = jnp.where(more_here, kb + 1, kv_block_range(nxt)[0])

            @pl.when(more_here | next_active)
            def _():
                start_fetch(next_w, next_kb, 1 - slot)

            wait_fetch(j, kb, slot)
            compute(j, kb, slot)
            step_ref[0] = step_ref[0] + 1
            return 0

        jax.lax.fori_loop(kb_lo, kb_hi, kv_body, 0)
        l, out = l_ref[...], acc_ref[...]
        if sink_ref is not None:  # one more key: score `sink`, value zero
            l, alpha = fold_sink(m_ref[...], l, sink_ref[...])
            out = alpha * out
        o_ref[0] = (out / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)

    @pl.when(jnp.logical_not(active))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@dataclasses.dataclass(frozen=True)
class PageStream:
    """A work item's KV blocks streamed from HBM into a double buffer, one DMA per page (and
    its scales row, under the same semaphore), the pages' ids fetched from the block tables
    in HBM a chunk at a time into SMEM (module doc). Shared by the kernels on this skeleton
    (`mla_attention_tpu.py` too), which give how a page of the cache is addressed."""

    kv_page: Callable  # page id -> the HBM ref view one DMA copies
    kv_buf: Any  # [2, kv_pages, ...page]  the double buffer
    scale_page: Callable | None  # page id -> its scales row (8-bit caches), else None
    scale_buf: Any
    sems: Any  # DMA semaphores [2], one per buffer slot
    tables_hbm_ref: Any  # i32[1, R * P']  block tables, rows padded to whole chunks
    tbuf: Any  # i32[table_chunk] (SMEM)
    tsem: Any  # DMA semaphore [1], the table chunk
    kv_pages: int
    page_size: int
    table_chunk: int
    padded_pages: int

    def copies(self, slot, i, page):
        """The DMAs of cache page `page` into position i of buffer `slot`."""
        out = [
            pltpu.make_async_copy(self.kv_page(page), self.kv_buf.at[slot, i], self.sems.at[slot])
        ]
        if self.scale_page is not None:
            out.append(
                pltpu.make_async_copy(
                    self.scale_page(page), self.scale_buf.at[slot, i], self.sems.at[slot]
                )
            )
        return out

    def pages_needed(self, kv_end, kb):
        """The pages of kv block kb that hold keys before `kv_end`: a prefix of the block (the
        others are past the request's length, and never copied)."""
        kv_tokens = self.kv_pages * self.page_size
        return jnp.clip(
            _div(kv_end - kb * kv_tokens + self.page_size - 1, self.page_size), 0, self.kv_pages
        )

    def start(self, r, kv_end, kb, slot):
        """Brings request r's page ids of block kb into SMEM, then starts the block's DMAs."""
        chunk = pl.multiple_of(
            r * self.padded_pages + _div(kb * self.kv_pages, self.table_chunk) * self.table_chunk,
            self.table_chunk,
        )
        copy = pltpu.make_async_copy(
            self.tables_hbm_ref.at[0, pl.ds(chunk, self.table_chunk)], self.tbuf, self.tsem.at[0]
        )
        copy.start()
        copy.wait()
        first = jax.lax.rem(kb * self.kv_pages, self.table_chunk)

        def start(i, _):
            for page_copy in self.copies(slot, i, self.tbuf[first + i]):
                page_copy.start()
            return 0

        jax.lax.fori_loop(0, self.pages_needed(kv_end, kb), start, 0)

    def wait(self, kv_end, kb, slot):
        def wait(i, _):  # a wait needs the copy's size and semaphore, not its source page
            for page_copy in self.copies(slot, i, 0):
                page_copy.wait()
            return 0

        jax.lax.fori_loop(0, self.pages_needed(kv_end, kb), wait, 0)


def _attend_kernel(
    layer_ref,
    window_ref,
    seq_lens_ref,
    cu_q_lens_ref,
    work_req_ref,
    work_tok_ref,
    work_end_ref,  # i32[W]  SMEM: keys [.., end) the item's rows see, past their causal end
    q_ref,
    last_ref,  # [1, bq * G, 1] i32: the last key position each row sees
    tables_hbm_ref,
    kv_hbm_ref,
    *refs,
    **kwargs,
):
    """`_kernel` with `attend_to`: two more operands, the rest unchanged."""
    _kernel(
        layer_ref, window_ref, seq_lens_ref, cu_q_lens_ref, work_req_ref, work_tok_ref, q_ref,
        tables_hbm_ref, kv_hbm_ref, *refs, attend_refs=(work_end_ref, last_ref), **kwargs,
    )  # fmt: skip


def _work_items(cu_q_lens, num_seqs, max_reqs: int, num_tokens: int, q_block: int):
    """Each request's queries cut into blocks of `q_block` tokens, one work item each: (request
    of each item (-1 past the last), its first token, the number of items W (a static bound:
    the sum of ceil(q_r / b) is at most ceil(T / b) + R - 1, and at most T), and for each token
    its row in the items' flattened [W * q_block] layout."""
    n = num_seqs[0]
    reqs = jnp.arange(max_reqs, dtype=jnp.int32)
    q_lens = jnp.where(reqs < n, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + q_block - 1) // q_block
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    num_work = min(num_tokens, -(-num_tokens // q_block) + max_reqs - 1)
    item = jnp.arange(num_work, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(ends, item, side="right"), max_reqs - 1).astype(jnp.int32)
    in_range = item < ends[-1]
    tok = cu_q_lens[req] + (item - starts[req]) * q_block
    work_req = jnp.where(in_range, req, -1)
    work_tok = jnp.where(in_range, tok, 0).astype(jnp.int32)
    # Token t of request r sits at row (starts[r] + (t - cu[r]) // b) * b + (t - cu[r]) % b.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    t_req = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), max_reqs - 1)
    local = t - cu_q_lens[t_req]
    t_row = (starts[t_req] + local // q_block) * q_block + local % q_block
    t_valid = t < cu_q_lens[n]
    return work_req, work_tok, num_work, jnp.where(t_valid, t_row, 0), t_valid


def kv_block_pages(kv_pages: int, num_kv_heads: int, page_size: int, head_dim: int, itemsize):
    """`kv_pages` capped so that the double-buffered KV block fits `_KV_BUFFER_BYTES` of VMEM
    (a power of two, at least 1)."""
    per_page = num_kv_heads * page_size * 2 * head_dim * itemsize
    cap = max(1, _KV_BUFFER_BYTES // (2 * per_page))
    kv_pages = max(1, min(kv_pages, cap))
    return 1 << (kv_pages.bit_length() - 1)


def ragged_paged_attention_tpu(
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
    q_block: int,
    kv_pages: int,
    kv_scales: jax.Array | None = None,  # f32[L, num_pages, 1, 2K * page_size]  8-bit only
    attend_to: jax.Array | None = None,  # i32[T]  see `ragged_paged_attention`
    sinks: jax.Array | None = None,  # f32[N]  see `ragged_paged_attention`
    attention_chunk: int | None = None,  # static  see `ragged_paged_attention`
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, N, H]
    """The Mosaic TPU kernel behind `ragged_paged_attention(..., backend="pallas_tpu")`.

    Shapes are checked by the public entry point; `q_block` (query tokens per work item, a
    power of two) and `kv_pages` (pages per KV block) come from `tuning.get_block_sizes`.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_pages, num_kv_heads, page_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    max_reqs, pages_per_seq = block_tables.shape
    kv_pages = kv_block_pages(
        min(kv_pages, pages_per_seq), num_kv_heads, page_size, head_dim, kv_cache.dtype.itemsize
    )
    q_block = max(1, min(q_block, num_tokens))
    rows = q_block * group

    work_req, work_tok, num_work, t_row, t_valid = _work_items(
        cu_q_lens, num_seqs, max_reqs, num_tokens, q_block
    )
    # Queries per work item, head-major: [W, K, bq * G, H], row i * G + g = token i, head k*G+g.
    src = jnp.minimum(work_tok[:, None] + jnp.arange(q_block, dtype=jnp.int32), num_tokens - 1)
    qw = q[src.reshape(-1)].reshape(num_work, q_block, num_kv_heads, group, head_dim)
    qw = qw.transpose(0, 2, 1, 3, 4).reshape(num_work, num_kv_heads, rows, head_dim)

    # Block tables flattened, each row padded to whole chunks (a DMA starts on a chunk).
    table_chunk = max(_TABLE_CHUNK, kv_pages)
    padded_pages = -(-pages_per_seq // table_chunk) * table_chunk
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))
    # One row: a 2-D operand (Pallas checks a 1-D one against the TPU generation, which an
    # ahead-of-time lowering may not know).
    tables = jnp.clip(tables, 0, num_pages - 1).reshape(1, -1)
    window = jnp.asarray(sliding_window, jnp.int32)
    span = jnp.where(window > 0, jnp.minimum(window, _NO_WINDOW), _NO_WINDOW)

    # With attend_to: each row's last key (its position, or past it within this step), and
    # each work item's key end, as the kernel's two more operands.
    attend_scalars, attend_in, attend_args = [], [], []
    if attend_to is not None:
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        t_req = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), max_reqs - 1)
        seq_t = seq_lens[t_req]
        pos = seq_t - (cu_q_lens[t_req + 1] - t)
        last = jnp.clip(jnp.maximum(pos, attend_to), pos, seq_t - 1).astype(jnp.int32)
        last_w = jnp.where(_rows_in_request(work_req, work_tok, cu_q_lens, src), last[src], -1)
        work_end = (last_w.max(axis=1) + 1).astype(jnp.int32)  # [W]
        last_rows = jnp.repeat(last_w, group, axis=1)[..., None]  # [W, bq * G, 1]
        attend_scalars, attend_args = [work_end], [last_rows]
        attend_in = [pl.BlockSpec((1, rows, 1), lambda w, *_: (w, 0, 0))]

    kernel = functools.partial(
        _kernel if attend_to is None else _attend_kernel,
        q_block=q_block,
        group=group,
        kv_pages=kv_pages,
        table_chunk=table_chunk,
        padded_pages=padded_pages,
        num_work=num_work,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        quantized=kv_scales is not None,
        sinks=sinks is not None,
        attention_chunk=attention_chunk,
    )
    # Each row's head's sink logit, [K, bq * G, 1] (row i * G + g: head k * G + g), whole in
    # every grid step.
    sink_in, sink_args = [], []
    if sinks is not None:
        per_row = jnp.tile(sinks.reshape(num_kv_heads, 1, group), (1, q_block, 1))
        sink_args = [per_row.reshape(num_kv_heads, rows, 1)]
        sink_in = [pl.BlockSpec((num_kv_heads, rows, 1), lambda w, *_: (0, 0, 0))]
    q_spec = pl.BlockSpec((1, num_kv_heads, rows, head_dim), lambda w, *_: (w, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM((2, kv_pages, num_kv_heads, page_size, 2 * head_dim), kv_cache.dtype)
    if kv_scales is None:
        extra_in, extra_args, buffers = [], [], [kv_buf]
    else:
        scale_buf = pltpu.VMEM((2, kv_pages, *kv_scales.shape[2:]), jnp.float32)
        extra_in, extra_args, buffers = [hbm], [kv_scales], [kv_buf, scale_buf]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6 + len(attend_scalars),
            grid=(num_work,),
            in_specs=[q_spec, *attend_in, hbm, hbm, *sink_in, *extra_in],
            out_specs=q_spec,
            scratch_shapes=[
                *buffers,
                pltpu.SMEM((table_chunk,), jnp.int32),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((1,)),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qw.shape, q.dtype),
        # Sequential: a grid step starts the next one's first KV block (see the module doc).
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=64 * 2**20
        ),
        interpret=interpret,
        cost_estimate=_cost(q, kv_cache, block_tables, kv_scales),
        name="ragged_paged_attention_tpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        span.reshape(1),
        seq_lens.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        work_req,
        work_tok,
        *attend_scalars,
        qw,
        *attend_args,
        tables,
        kv_cache,
        *sink_args,
        *extra_args,
    )
    # Back to [T, N, H]: token t is row t_row[t] of the items' [W * bq] rows.
    out = out.reshape(num_work, num_kv_heads, q_block, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_work * q_block, num_heads, head_dim)[t_row]
    return jnp.where(t_valid[:, None, None], out, jnp.zeros_like(out))


def _rows_in_request(work_req, work_tok, cu_q_lens, src):
    """bool[W, bq]: which of each work item's rows (tokens `src`) are its request's."""
    r = jnp.maximum(work_req, 0)
    return (work_req[:, None] >= 0) & (src < cu_q_lens[r + 1][:, None]) & (src >= work_tok[:, None])


def _cost(q, kv_cache, block_tables, kv_scales) -> pl.CostEstimate:
    flops, transcendentals, nbytes = attention_cost(
        q.shape, q.dtype, kv_cache.shape, kv_cache.dtype, block_tables.shape, kv_scales is not None
    )
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=nbytes)
