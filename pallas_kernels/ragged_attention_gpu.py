"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Why Triton and not Mosaic GPU: Mosaic GPU is where JAX is heading on Hopper (warp-specialized
pipelines through TMA), but it has no gather: a paged cache needs each KV block assembled from
pages picked by a block table, which Triton does with one pointer gather (`kv[layer, pages]`).
The Triton path also runs on Ampere and lowers on any machine, so the kernel can be checked
on CPU in interpret mode and lowered for CUDA without a GPU. A Mosaic GPU kernel (TMA per
page) is the natural next step once its gather story settles.

The grid is (query block, kv head). Unlike the TPU kernel, a query block never spans two
requests: the wrapper cuts each request's queries into blocks of `q_block` tokens and gives
each block its own program, so a decode batch of B sequences runs B x K programs in parallel,
each streaming one sequence's pages once. Programs past the last block do nothing.

Query rows are laid out head-major with the group padded to a power of two (Triton wants
power-of-two block shapes): `[K, T' * Gp, H]`, row t * Gp + g being token t, head k * G + g.
KV loads are masked by the request's length, so pages past it are never read, and stores are
masked to the program's own rows.

The sliding window is an input ref, so it may be traced (a layer scan's per-layer window). The
wrapper turns it into a span, the number of keys a row sees back from itself (`_NO_WINDOW`,
more than any sequence, for full attention), so the kernel has one code path: a row at
position q sees keys q - span < k <= q, and a program's KV loop starts at the block holding its
first row's first visible key, never loading the pages before the window.

An 8-bit cache (`kv_cache.py`): its block is widened to q's dtype before the matmuls and its
per-key scales, gathered like the pages, multiply the scores (K) and probabilities (V).

Split-KV (flash-decoding): with few programs against the SMs (a decode of one sequence is K
programs, each walking the whole context, on an H100's 132 SMs), the grid gains a third axis of
`num_splits`: split s of a program walks its s-th share of the KV blocks and writes its
unnormalized partial output with its running max and sum, which the wrapper combines (each
share rescaled by exp(its max - the max), summed, divided by the rescaled sums). The tuning
table says when (`tuning.get_block_sizes`); with one split the kernel writes its output as
before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention_sinks import fold_sink
from pallas_kernels.kv_cache import attention_cost, widen_kv

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The window span of full attention: longer than any sequence, and small enough that
# `position - span` cannot overflow i32.
_NO_WINDOW = 1 << 30


def _kernel(
    layer_ref,  # i32[1]
    window_ref,  # i32[1]            window span: keys a row sees back from itself (>= 1)
    seq_lens_ref,  # i32[R]
    tables_ref,  # i32[R, P']        P' = P padded to a multiple of kv_pages
    cu_q_lens_ref,  # i32[R + 1]
    prog_req_ref,  # i32[B]           request of each query block, -1 past the last block
    prog_tok_ref,  # i32[B]           first token of each query block
    q_ref,  # [K, T' * Gp, H]
    kv_ref,  # [L, num_pages, K, page_size, 2H]
    *refs,  # with attend_to: attend_ref i32[T']; with sinks: sinks_ref f32[K * Gp] (head
    # k * G + g's sink at k * Gp + g); with an 8-bit cache scales_ref f32[L,
    # num_pages, 1, 2K * page_size]; then o_ref [K, T' * Gp, H], or with num_splits > 1 the
    # partial outputs: acc_ref f32[S, K, T' * Gp, H], m_ref and l_ref f32[S, K, T' * Gp]
    q_block: int,
    group_padded: int,
    kv_pages: int,
    sm_scale: float,
    soft_cap: float | None,
    attend: bool = False,
    sinks: bool = False,
    attention_chunk: int | None = None,
    num_splits: int = 1,
):
    refs = list(refs)
    if num_splits > 1:
        *refs, acc_ref, m_ref, l_ref = refs
    else:
        *refs, o_ref = refs
    attend_ref = refs.pop(0) if attend else None
    sinks_ref = refs.pop(0) if sinks else None
    scales_ref = refs[0] if refs else None
    j, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, head_dim = kv_ref.shape[3], kv_ref.shape[4] // 2
    kv_tokens = kv_pages * page_size
    rows = q_block * group_padded
    r = prog_req_ref[j]

    @pl.when(r >= 0)
    def _():
        layer, window = layer_ref[0], window_ref[0]
        tok0 = prog_tok_ref[j]
        q_start, q_end, seq_len = cu_q_lens_ref[r], cu_q_lens_ref[r + 1], seq_lens_ref[r]
        row_tok = tok0 + jax.lax.div(jnp.arange(rows, dtype=jnp.int32), group_padded)
        row_ok = row_tok < q_end  # [rows]
        row_pos = seq_len - (q_end - q_start) + (row_tok - q_start)  # [rows]
        kv_end = seq_len - (q_end - jnp.minimum(q_end, tok0 + q_block))
        row_last = row_pos  # [rows] the last key each row sees
        if attend_ref is not None:  # a block's rows see each other: this step's keys
            reach = pltriton.load(attend_ref.at[row_tok])
            row_last = jnp.minimum(jnp.maximum(row_pos, reach), seq_len - 1)
            kv_end = jnp.maximum(kv_end, jnp.where(row_ok, row_last, -1).max() + 1)
        first_pos = seq_len - (q_end - tok0)
        kv_begin = jnp.maximum(first_pos - window + 1, 0)
        if attention_chunk is not None:  # the first row's chunk starts first
            chunk = jnp.int32(attention_chunk)
            kv_begin = jnp.maximum(kv_begin, jax.lax.div(first_pos, chunk) * chunk)

        q = q_ref[h, pl.ds(tok0 * group_padded, rows), :]  # [rows, H]
        offsets = jnp.arange(page_size, dtype=jnp.int32)
        dims = jnp.arange(head_dim, dtype=jnp.int32)

        def body(kb, carry):
            m, l, acc = carry  # [rows], [rows], [rows, H]
            pages = tables_ref[r, pl.ds(kb * kv_pages, kv_pages)]  # [kv_pages]
            kv_pos = kb * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)  # [kv]
            load_ok = (kv_pos < kv_end).reshape(kv_pages, page_size, 1)
            # A gather of whole pages, indexed with arrays on every axis (the interpreter
            # cannot mix array indices with slices): the key is lanes [0, H) of each token's
            # row, the value lanes [H, 2H).
            idx = (layer, pages[:, None, None], h, offsets[None, :, None])
            k, v = (
                pltriton.load(
                    kv_ref.at[(*idx, (first + dims)[None, None, :])], mask=load_ok, other=0
                ).reshape(kv_tokens, head_dim)
                for first in (0, head_dim)
            )
            if scales_ref is not None:
                # An 8-bit cache: the matmuls take q's dtype (int8 and e4m3 are exact in
                # bfloat16), and the per-key scales go onto the scores and probabilities.
                k, v = widen_kv(k, q.dtype), widen_kv(v, q.dtype)
                page_ok = load_ok.reshape(kv_pages, page_size)
                k_scale, v_scale = (
                    pltriton.load(
                        scales_ref.at[layer, pages[:, None], 0, (lane0 + offsets)[None, :]],
                        mask=page_ok,
                        other=0,
                    ).reshape(kv_tokens)
                    for lane0 in (2 * h * page_size, (2 * h + 1) * page_size)
                )
            s = pltriton.dot(q.astype(k.dtype), k, trans_b=True).astype(jnp.float32)
            if scales_ref is not None:
                s = s * k_scale[None, :]
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = row_ok[:, None] & (kv_pos[None, :] <= row_last[:, None])
            mask &= kv_pos[None, :] > row_pos[:, None] - window
            if attention_chunk is not None:  # each row's own chunk
                start = jax.lax.div(row_pos, jnp.int32(attention_chunk)) * attention_chunk
                mask &= kv_pos[None, :] >= start[:, None]
            s = jnp.where(mask, s, _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(axis=1)
            if scales_ref is not None:
                p = p * v_scale[None, :]
            acc = alpha[:, None] * acc + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
            return m_new, l, acc

        init = (
            jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )
        kb_lo = jax.lax.div(kv_begin, kv_tokens)
        kb_hi = jax.lax.div(kv_end + kv_tokens - 1, kv_tokens)
        here = pl.ds(tok0 * group_padded, rows)
        if num_splits == 1:
            m, l, acc = jax.lax.fori_loop(kb_lo, kb_hi, body, init)
            if sinks_ref is not None:  # one more key: score `sink`, value zero
                g = jax.lax.rem(jnp.arange(rows, dtype=jnp.int32), group_padded)
                l, alpha = fold_sink(m, l, pltriton.load(sinks_ref.at[h * group_padded + g]))
                acc = alpha[:, None] * acc
            out = (acc / jnp.where(l > 0.0, l, 1.0)[:, None]).astype(o_ref.dtype)
            pltriton.store(o_ref.at[h, here, :], out, mask=row_ok[:, None])
            return
        # This split's share of the KV blocks (none past the last: it writes an empty share).
        share = jax.lax.div(kb_hi - kb_lo + num_splits - 1, num_splits)
        lo = jnp.minimum(kb_lo + split * share, kb_hi)
        m, l, acc = jax.lax.fori_loop(lo, jnp.minimum(lo + share, kb_hi), body, init)
        pltriton.store(acc_ref.at[split, h, here, :], acc, mask=row_ok[:, None])
        pltriton.store(m_ref.at[split, h, here], m, mask=row_ok)
        pltriton.store(l_ref.at[split, h, here], l, mask=row_ok)


def ragged_paged_attention_gpu(
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
    num_warps: int = 4,
    num_stages: int = 2,
    num_splits: int = 1,
    kv_scales: jax.Array | None = None,  # f32[L, num_pages, 1, 2K * page_size]  8-bit only
    attend_to: jax.Array | None = None,  # i32[T]  see `ragged_paged_attention`
    sinks: jax.Array | None = None,  # f32[N]  see `ragged_paged_attention`
    attention_chunk: int | None = None,  # static  see `ragged_paged_attention`
    interpret: bool = False,
) -> jax.Array:  # [T, N, H]
    """The Triton kernel behind `ragged_paged_attention(..., backend="pallas_gpu")`.

    Shapes are checked by the public entry point; the block sizes come from
    `tuning.get_block_sizes`. `q_block` and `kv_pages` must be powers of two; `num_splits`
    (split-KV) shares of each program's KV blocks run as programs of their own.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_pages, num_kv_heads, page_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    group_padded = pl.next_power_of_2(group)
    max_reqs, pages_per_seq = block_tables.shape
    # Triton's dot wants at least 16 rows.
    q_block = max(q_block, 16 // min(group_padded, 16))

    n = num_seqs[0]
    prog_req, prog_tok, num_programs = query_blocks(cu_q_lens, num_seqs, num_tokens, q_block)

    # Rows a block may touch past the end, and block-table columns a kv block may read past
    # the end, are padded so no slice ever leaves its array.
    padded_tokens = num_tokens + q_block
    qh = jnp.pad(q, ((0, q_block), (0, 0), (0, 0))).reshape(
        padded_tokens, num_kv_heads, group, head_dim
    )
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))
    qh = qh.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group_padded, head_dim)
    padded_pages = -(-pages_per_seq // kv_pages) * kv_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))
    tables = jnp.clip(tables, 0, num_pages - 1).astype(jnp.int32)
    window = jnp.asarray(sliding_window, jnp.int32)
    span = jnp.where(window > 0, jnp.minimum(window, _NO_WINDOW), _NO_WINDOW)

    kernel = functools.partial(
        _kernel,
        q_block=q_block,
        group_padded=group_padded,
        kv_pages=kv_pages,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        attend=attend_to is not None,
        # With splits the wrapper folds the sinks into the combined shares instead.
        sinks=sinks is not None and num_splits == 1,
        attention_chunk=attention_chunk,
        num_splits=num_splits,
    )
    attend = [] if attend_to is None else [jnp.pad(attend_to, (0, q_block), constant_values=-1)]
    # Sinks per (kv head, padded group slot).
    sink_rows = None
    if sinks is not None:
        sink_rows = jnp.pad(sinks.reshape(num_kv_heads, group), ((0, 0), (0, group_padded - group)))
    in_kernel_sinks = [] if sink_rows is None or num_splits > 1 else [sink_rows.reshape(-1)]
    out_shape = jax.ShapeDtypeStruct(qh.shape, q.dtype)
    if num_splits > 1:
        partial = (num_splits, *qh.shape[:2])
        out_shape = (
            jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
        )
    out = pl.pallas_call(
        kernel,
        grid=(num_programs, num_kv_heads, num_splits),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=_cost(q, kv_cache, block_tables, kv_scales),
        name="ragged_paged_attention_gpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        span.reshape(1),
        seq_lens.astype(jnp.int32),
        tables,
        cu_q_lens.astype(jnp.int32),
        prog_req,
        prog_tok,
        qh,
        kv_cache,
        *attend,
        *in_kernel_sinks,
        *([] if kv_scales is None else [kv_scales]),
    )
    if num_splits > 1:
        row_sinks = None if sink_rows is None else jnp.tile(sink_rows, (1, padded_tokens))
        out = _combine_splits(*out, row_sinks).astype(q.dtype)
    out = out.reshape(num_kv_heads, padded_tokens, group_padded, head_dim)[:, :num_tokens, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)
    # Rows no program owns (padding tokens) were never written.
    valid = jnp.arange(num_tokens) < cu_q_lens[n]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


def query_blocks(
    cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, q_block: int
) -> tuple[jax.Array, jax.Array, int]:
    """Each request's tokens cut into blocks of `q_block`, one program each: (the request of
    each program, -1 past the last block; its first token; the number of programs, a static
    bound: sum(ceil(q / b)) <= T / b + R)."""
    max_reqs = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(max_reqs) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + q_block - 1) // q_block
    ends = jnp.cumsum(blocks)
    num_programs = num_tokens // q_block + max_reqs
    prog = jnp.arange(num_programs, dtype=jnp.int32)
    # By comparing all pairs (R x programs, small): the default method is a loop, and XLA:GPU
    # runs a `while` by asking the host each trip (a host sync in every step).
    prog_req = jnp.searchsorted(ends, prog, side="right", method="compare_all").astype(jnp.int32)
    in_range = prog < ends[-1]
    prog_req = jnp.where(in_range, prog_req, -1)
    safe_req = jnp.clip(prog_req, 0, max_reqs - 1)
    prog_tok = cu_q_lens[safe_req] + (prog - (ends[safe_req] - blocks[safe_req])) * q_block
    prog_tok = jnp.where(in_range, prog_tok, 0).astype(jnp.int32)
    return prog_req, prog_tok, num_programs


def _combine_splits(
    acc: jax.Array, m: jax.Array, l: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """The attention output from the splits' partial ones: acc f32[S, K, rows, H] unnormalized,
    m and l f32[S, K, rows] their running maxima and sums, `sinks` f32[K, rows] each row's sink
    logit (or None). Rows no program wrote hold garbage and are dropped by the caller."""
    top = m.max(axis=0)
    w = jnp.exp(m - top[None])  # 0 for an empty share (its max is the mask value)
    total = (w * l).sum(axis=0)
    out = (w[..., None] * acc).sum(axis=0)
    if sinks is not None:
        total, alpha = fold_sink(top, total, sinks)
        out = alpha[..., None] * out
    return out / jnp.where(total > 0.0, total, 1.0)[..., None]


def _cost(q, kv_cache, block_tables, kv_scales) -> pl.CostEstimate:
    flops, transcendentals, nbytes = attention_cost(
        q.shape, q.dtype, kv_cache.shape, kv_cache.dtype, block_tables.shape, kv_scales is not None
    )
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=nbytes)
