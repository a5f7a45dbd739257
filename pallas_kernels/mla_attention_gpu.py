"""Multi-head latent attention (`mla_attention.py`) as a Pallas kernel for NVIDIA GPUs (Triton
lowering): the same absorbed form over the same cache, without the reference's context loop,
which XLA:GPU runs by asking the host for every trip's predicate (a host sync per chunk, per
layer, per step).

The grid is (query block, head block), as `ragged_attention_gpu.py`'s is (query block, kv
head): each request's queries are cut into blocks of `q_block` tokens, a program per block,
and the heads (padded to a power of two) into blocks of `head_block`. Every program reads the
one latent row per token that all heads share: its KV loop walks the request's pages in tiles
of `kv_pages` pages, loading each token's latent (L lanes, padded to a power of two with
masked loads, as Triton's blocks must be) and its RoPE key (R lanes) from its half of its pair
row (`mla_attention.py`), scoring `[ql | q_pe]` against them in two dots, and accumulating the
softmax-weighted latents with an online softmax. A decode of one request at V3's 128 heads is 8 programs of 16
heads, each streaming the request's rows once (the whole cache row is read by every head
block: 8 reads of 1,152 bytes a token, against 128 x 2 x 128 x 2 expanded).

An 8-bit cache: each row has one scale, which multiplies the row's latent and RoPE key
before the dots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_cache import widen_kv
from pallas_kernels.ragged_attention_gpu import query_blocks

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(
    layer_ref,  # i32[1]
    seq_lens_ref,  # i32[S]
    tables_ref,  # i32[S, P']  P' = P padded to a multiple of kv_pages
    cu_q_lens_ref,  # i32[S + 1]
    prog_req_ref,  # i32[B]  request of each query block, -1 past the last block
    prog_tok_ref,  # i32[B]  first token of each query block
    ql_ref,  # [head blocks, T' * head_block, Lp]
    qr_ref,  # [head blocks, T' * head_block, Rp]
    kv_ref,  # [layers, num_pages, 1, page_size / 2, lanes]  pair rows
    *refs,  # with an 8-bit cache scales_ref f32[layers, num_pages, 1, >= page_size]; o_ref
    q_block: int,
    head_block: int,
    kv_pages: int,
    sm_scale: float,
    latent: int,
    rope: int,
):
    *refs, o_ref = refs
    scales_ref = refs[0] if refs else None
    j, hb = pl.program_id(0), pl.program_id(1)
    page_size = 2 * kv_ref.shape[3]
    kv_tokens = kv_pages * page_size
    rows = q_block * head_block
    latent_p, rope_p = ql_ref.shape[-1], qr_ref.shape[-1]
    r = prog_req_ref[j]

    @pl.when(r >= 0)
    def _():
        layer, tok0 = layer_ref[0], prog_tok_ref[j]
        q_start, q_end, seq_len = cu_q_lens_ref[r], cu_q_lens_ref[r + 1], seq_lens_ref[r]
        row_tok = tok0 + jax.lax.div(jnp.arange(rows, dtype=jnp.int32), head_block)
        row_ok = row_tok < q_end
        row_pos = seq_len - (q_end - q_start) + (row_tok - q_start)
        kv_end = seq_len - (q_end - jnp.minimum(q_end, tok0 + q_block))
        here = pl.ds(tok0 * head_block, rows)
        ql, qr = ql_ref[hb, here, :], qr_ref[hb, here, :]
        offsets = jnp.arange(page_size, dtype=jnp.int32)
        # Where each wanted lane of a token's latent and RoPE key sits in its pair row: an
        # odd offset's parts follow the even one's.
        odd = (offsets % 2)[None, :, None]
        want_lat = jnp.minimum(jnp.arange(latent_p, dtype=jnp.int32), latent - 1)[None, None, :]
        want_pe = jnp.minimum(jnp.arange(rope_p, dtype=jnp.int32), rope - 1)[None, None, :]
        lane_lat = odd * latent + want_lat
        lane_pe = 2 * latent + odd * rope + want_pe
        lat_ok = jnp.arange(latent_p) < latent
        pe_ok = jnp.arange(rope_p) < rope

        def body(kb, carry):
            m, l, acc = carry  # [rows], [rows], [rows, Lp]
            pages = tables_ref[r, pl.ds(kb * kv_pages, kv_pages)]
            kv_pos = kb * kv_tokens + jnp.arange(kv_tokens, dtype=jnp.int32)
            load_ok = (kv_pos < kv_end).reshape(kv_pages, page_size, 1)
            idx = (layer, pages[:, None, None], 0, (offsets // 2)[None, :, None])
            c, k_pe = (
                pltriton.load(
                    kv_ref.at[(*idx, lanes)], mask=load_ok & ok[None, None, :], other=0
                ).reshape(kv_tokens, width)
                for lanes, ok, width in ((lane_lat, lat_ok, latent_p), (lane_pe, pe_ok, rope_p))
            )
            if scales_ref is not None:  # the row's scale on both parts
                scale = pltriton.load(
                    scales_ref.at[layer, pages[:, None], 0, offsets[None, :]],
                    mask=load_ok.reshape(kv_pages, page_size),
                    other=0,
                ).reshape(kv_tokens, 1)
                c, k_pe = ((widen_kv(x) * scale).astype(ql.dtype) for x in (c, k_pe))
            s = pltriton.dot(ql.astype(c.dtype), c, trans_b=True).astype(jnp.float32)
            s += pltriton.dot(qr.astype(k_pe.dtype), k_pe, trans_b=True).astype(jnp.float32)
            s = s * sm_scale
            mask = row_ok[:, None] & (kv_pos[None, :] <= row_pos[:, None])
            s = jnp.where(mask, s, _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + pltriton.dot(p.astype(c.dtype), c).astype(jnp.float32)
            return m_new, l, acc

        init = (
            jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, latent_p), jnp.float32),
        )
        num_blocks = jax.lax.div(kv_end + kv_tokens - 1, kv_tokens)
        m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
        out = acc / jnp.where(l > 0.0, l, 1.0)[:, None]
        pltriton.store(o_ref.at[hb, here, :], out, mask=row_ok[:, None])


def mla_paged_attention_gpu(
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
    head_block: int = 16,
    kv_tokens: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # f32[T, N, L]
    """The Triton kernel behind `mla_paged_attention(..., backend="pallas_gpu")`: heads in
    blocks of `head_block` (a power of two), the KV loop in tiles of `kv_tokens` (pages of a
    tile: `kv_tokens // page_size`, at least one)."""
    num_tokens, num_heads, latent = ql.shape
    rope = q_pe.shape[-1]
    _, num_pages, _, pairs, _ = kv_cache.shape
    page_size = 2 * pairs
    max_reqs, pages_per_seq = block_tables.shape
    heads_p = pl.next_power_of_2(num_heads)
    head_block = min(head_block, heads_p)
    num_head_blocks = heads_p // head_block
    q_block = max(1, 16 // head_block)  # Triton's dot wants 16 rows
    kv_pages = max(1, kv_tokens // page_size)
    # Triton's blocks: powers of two, at least 16 wide
    latent_p, rope_p = (max(16, pl.next_power_of_2(n)) for n in (latent, rope))

    prog_req, prog_tok, num_programs = query_blocks(cu_q_lens, num_seqs, num_tokens, q_block)
    padded_tokens = num_tokens + q_block

    def blocked(q, width):  # [T, N, X] -> [head blocks, T' * head_block, width]
        q = jnp.pad(q, ((0, q_block), (0, heads_p - num_heads), (0, width - q.shape[-1]))).reshape(
            padded_tokens, num_head_blocks, head_block, width
        )
        return q.transpose(1, 0, 2, 3).reshape(num_head_blocks, -1, width)

    padded_pages = -(-pages_per_seq // kv_pages) * kv_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))
    tables = jnp.clip(tables, 0, num_pages - 1).astype(jnp.int32)
    kernel = functools.partial(
        _kernel,
        q_block=q_block,
        head_block=head_block,
        kv_pages=kv_pages,
        sm_scale=sm_scale,
        latent=latent,
        rope=rope,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_programs, num_head_blocks),
        out_shape=jax.ShapeDtypeStruct(
            (num_head_blocks, padded_tokens * head_block, latent_p), jnp.float32
        ),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_paged_attention_gpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        seq_lens.astype(jnp.int32),
        tables,
        cu_q_lens.astype(jnp.int32),
        prog_req,
        prog_tok,
        blocked(ql, latent_p),
        blocked(q_pe.astype(ql.dtype), rope_p),
        kv_cache,
        *([] if kv_scales is None else [kv_scales]),
    )
    out = out.reshape(num_head_blocks, padded_tokens, head_block, latent_p)
    out = out.transpose(1, 0, 2, 3).reshape(padded_tokens, heads_p, latent_p)
    out = out[:num_tokens, :num_heads, :latent]
    valid = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]  # rows no program owns
    return jnp.where(valid[:, None, None], out, 0.0)
