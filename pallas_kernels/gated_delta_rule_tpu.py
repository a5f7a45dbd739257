"""The gated delta rule's prefill chunks as a Mosaic TPU kernel.

The caller (`gated_delta_rule(..., backend="pallas_tpu")`) has already taken every request's
first token in one batched one-token update (a decode step is only that). What is left are the
prefill tokens past each request's first, cut into work items of `chunk` tokens of one request;
this kernel runs them with the chunk algebra of `delta_rule_chunk.chunk_algebra`.

Grid: one program per value head ("parallel": a megacore chip splits the heads between its
cores). Each walks the step's work items in order, its head's [Dk, Dv] state in VMEM, loaded
at a request's first item and written back after its last. The loop's trip count comes from
scalar memory, so a step with no prefill costs a program per head and no more.

No gather, no transpose: q, k and v stay as the model made them, token-major [T, H, D] in HBM,
and a work item's rows of one head are a strided DMA (`x.at[rows, head, :]`, 512-byte runs)
at any token offset; the decays and write strengths come as the item's [C, H] rows and the
head's column is picked with a mask (Mosaic has no dynamic lane slice). Fetches are
double-buffered: while item n is computed, item n + 1's rows are on their way. Every DMA has a
fixed size (a request's last item reads and writes a whole chunk; rows past its tokens are
zeroed on the way in) so the kernel runs in Pallas' interpret mode on a CPU.

Outputs. A whole-chunk write of a request's last item runs past its tokens, onto tokens that
are either later items' (written after it: each item's write waits for the one before) or not
the kernel's (first tokens, decode rows, padding), which the wrapper takes from the one-token
update instead. The states are aliased in and out: requests without an item keep theirs, and
no copy of the state array is made.

The chunk's (I + A)^-1 is blocked inversion by doubling on whole [C, C] matrices: the exact
inverses of 1-, 2-, 4-... row diagonal blocks merged in pairs by two matmuls each, the blocks
picked with masks (no slicing of values), stable as forward substitution is (every step is the
exact inverse of a smaller block) and 2 log2(C) MXU matmuls instead of C sequential rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.delta_rule_chunk import chunk_algebra, pad_to, token_rows

_HIGHEST = jax.lax.Precision.HIGHEST
_LANES = 128
_FIRST, _LAST = 1, 2  # work-item flags


def _dot(x, y, trans_a, trans_b):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(x, y, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


def doubling_inverse(a):
    """(I + a)^-1 for a strictly lower-triangular a [C, C] (C a power of two). With T the
    block-diagonal matrix of the exact inverses of the diagonal blocks of `size` rows, and L
    the part of a in the lower-left quarters of the blocks of 2 `size` rows, T - T L T is the
    same for blocks of 2 `size`: [[P, 0], [X, Q]]^-1 = [[P^-1, 0], [-Q^-1 X P^-1, Q^-1]]."""
    c = a.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    inverse = (i == j).astype(a.dtype)
    shift = 0
    while (1 << shift) < c:
        # Shifts, not floor division: Mosaic lowers signed `//` through `sign`.
        same_pair = (i >> (shift + 1)) == (j >> (shift + 1))
        lower_left = same_pair & ((i >> shift) != (j >> shift))
        off = jnp.where(lower_left, a, 0.0)
        inverse = inverse - _dot(_dot(inverse, off, False, False), inverse, False, False)
        shift += 1
    return inverse


def _kernel(
    # Scalar prefetch (SMEM).
    num_items_ref,  # i32[1]
    item_req_ref,  # i32[W]     each work item's request
    item_begin_ref,  # i32[W]   its first token
    item_count_ref,  # i32[W]   its tokens (1..C)
    item_flags_ref,  # i32[W]   _FIRST | _LAST of its request
    # HBM.
    q_hbm,  # f32[T + C, H, Dk]
    k_hbm,  # f32[T + C, H, Dk]
    v_hbm,  # f32[T + C, H, Dv]
    g_hbm,  # f32[T + C, H]
    b_hbm,  # f32[T + C, H]
    s_hbm,  # f32[R, H, Dk, Dv], aliased to s_out_hbm
    o_hbm,  # f32[T + C, H, Dv]: the items' rows; others untouched (the wrapper's)
    s_out_hbm,
    # Scratch.
    q_buf,  # f32[2, C, Dk]
    k_buf,  # f32[2, C, Dk]
    v_buf,  # f32[2, C, Dv]
    g_buf,  # f32[2, C, H]
    b_buf,  # f32[2, C, H]
    o_buf,  # f32[C, Dv]
    s_buf,  # f32[Dk, Dv]
    in_sems,  # DMA[2]: one per buffer slot
    o_sem,  # DMA[1]
    s_sem,  # DMA[1]
    *,
    chunk: int,
):
    h = pl.program_id(0)
    num_items = num_items_ref[0]

    def fetches(n, slot):
        rows = pl.ds(item_begin_ref[n], chunk)
        pairs = (
            (q_hbm.at[rows, h, :], q_buf),
            (k_hbm.at[rows, h, :], k_buf),
            (v_hbm.at[rows, h, :], v_buf),
            (g_hbm.at[rows, :], g_buf),
            (b_hbm.at[rows, :], b_buf),
        )
        return [pltpu.make_async_copy(src, buf.at[slot], in_sems.at[slot]) for src, buf in pairs]

    def output(n):
        rows = pl.ds(item_begin_ref[n], chunk)
        return pltpu.make_async_copy(o_buf, o_hbm.at[rows, h, :], o_sem.at[0])

    def state(r, load):
        src, dst = (s_hbm.at[r, h], s_buf) if load else (s_buf, s_out_hbm.at[r, h])
        copy = pltpu.make_async_copy(src, dst, s_sem.at[0])
        copy.start()
        copy.wait()

    @pl.when(num_items > 0)
    def _():
        for copy in fetches(0, 0):
            copy.start()

    def body(n, carry):
        slot = jax.lax.rem(n, 2)

        @pl.when(n + 1 < num_items)
        def _():
            for copy in fetches(n + 1, 1 - slot):
                copy.start()

        for copy in fetches(n, slot):
            copy.wait()
        r, flags = item_req_ref[n], item_flags_ref[n]

        @pl.when((flags & _FIRST) != 0)
        def _():
            state(r, load=True)

        ok = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < item_count_ref[n]  # [C, 1]
        head = jax.lax.broadcasted_iota(jnp.int32, (1, g_buf.shape[-1]), 1) == h

        def column(buf):  # this head's [C, 1], zero past the item's tokens
            return jnp.where(ok, jnp.sum(jnp.where(head, buf[slot], 0.0), 1, keepdims=True), 0.0)

        q, k, v = (jnp.where(ok, buf[slot], 0.0) for buf in (q_buf, k_buf, v_buf))
        o, s = chunk_algebra(
            s_buf[...], q, k, v, column(g_buf), column(b_buf), dot=_dot, invert=doubling_inverse
        )
        s_buf[...] = s

        @pl.when(n > 0)
        def _():
            output(n - 1).wait()  # o_buf is free, and the writes land in order

        o_buf[...] = o
        output(n).start()

        @pl.when((flags & _LAST) != 0)
        def _():
            state(r, load=False)

        return carry

    jax.lax.fori_loop(0, num_items, body, 0)

    @pl.when(num_items > 0)
    def _():
        output(num_items - 1).wait()


def max_work_items(num_tokens: int, num_reqs: int, chunk: int) -> int:
    """A bound on a step's work items: a request with prefill tokens past its first (at most
    one per two tokens) has one partial item at most, the rest are whole."""
    return num_tokens // chunk + max(1, min(num_reqs, num_tokens // 2))


def work_items(starts, q_lens, num_tokens: int, chunk: int):
    """The items of `chunk` tokens past each request's first: (count i32[1], request, first
    token, tokens, flags, each i32[W])."""
    num_reqs = starts.shape[0]
    rest = jnp.maximum(q_lens - 1, 0)
    per_request = (rest + chunk - 1) // chunk
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_request, dtype=jnp.int32)])
    n = jnp.arange(max_work_items(num_tokens, num_reqs, chunk), dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(cu[1:], n, side="right", method="compare_all"), num_reqs - 1)
    index = n - cu[req]
    live = n < cu[-1]
    begin = jnp.where(live, starts[req] + 1 + index * chunk, 0)
    count = jnp.where(live, jnp.minimum(rest[req] - index * chunk, chunk), 0)
    flags = jnp.where(index == 0, _FIRST, 0) | jnp.where(index == per_request[req] - 1, _LAST, 0)
    # Past the last item: the last request's, so no state moves.
    return cu[-1:], req, begin, count, jnp.where(live, flags, 0)


def gated_delta_rule_rest(q, k, v, g, beta, state, out, starts, q_lens, *, chunk, interpret):
    """The tokens past each request's first, on top of `gated_delta_rule`'s one-token update:
    `state` the states after each request's first token, `out` [T, H, Dv] that update's
    outputs. Returns (o [T, H, Dv], the states after each request's tokens)."""
    num_tokens, num_heads, dk = q.shape
    dv = v.shape[-1]
    dk_p, dv_p = (-(-d // _LANES) * _LANES for d in (dk, dv))

    tokens = num_tokens + chunk  # a request's last item may read and write past the batch
    q, k = (pad_to(x, tokens, num_heads, dk_p) for x in (q, k))
    v = pad_to(v, tokens, num_heads, dv_p)
    g, beta = (pad_to(x, tokens, num_heads) for x in (g, beta))
    s = pad_to(state, state.shape[0], num_heads, dk_p, dv_p)
    items = work_items(starts, q_lens, num_tokens, chunk)
    num_items = items[1].shape[0]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    o, s = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(items),
            grid=(num_heads,),
            in_specs=[hbm] * 6,
            out_specs=[hbm, hbm],
            scratch_shapes=[
                pltpu.VMEM((2, chunk, dk_p), jnp.float32),
                pltpu.VMEM((2, chunk, dk_p), jnp.float32),
                pltpu.VMEM((2, chunk, dv_p), jnp.float32),
                pltpu.VMEM((2, chunk, num_heads), jnp.float32),
                pltpu.VMEM((2, chunk, num_heads), jnp.float32),
                pltpu.VMEM((chunk, dv_p), jnp.float32),
                pltpu.VMEM((dk_p, dv_p), jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((1,)),
                pltpu.SemaphoreType.DMA((1,)),
            ],
        ),
        out_shape=(
            jax.ShapeDtypeStruct((tokens, num_heads, dv_p), jnp.float32),
            jax.ShapeDtypeStruct(s.shape, jnp.float32),
        ),
        input_output_aliases={len(items) + 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(
            **_cost(num_items, num_heads, dk_p, dv_p, min(num_items, state.shape[0]), chunk)
        ),
        interpret=interpret,
        name="gated_delta_rule_tpu",
    )(*items, q, k, v, g, beta, s)
    _, _, rest = token_rows(starts, q_lens, num_tokens)
    out = jnp.where(rest[:, None, None], o[:num_tokens, :, :dv], out)
    return out, s[:, :, :dk, :dv]


def _cost(items: int, heads: int, dk: int, dv: int, states: int, c: int) -> dict[str, int]:
    """The kernel's flops, exps and bytes as declared to XLA: an upper bound, every work item
    a whole chunk (the items are data). Per item and head, the [C, C] products (k k^T, q k^T,
    the inverse's 2 log2(C) matmuls, T times k and v, scores times u), the [C, D] x [D, D]
    ones (with the state, and the state's update), and the exps of the decay matrix."""
    per_item = c * c * (6 * dk + 4 * dv) + 4 * (c.bit_length() - 1) * c**3 + 6 * c * dk * dv
    rows = items * c * heads
    return dict(
        flops=items * heads * per_item,
        transcendentals=rows * (c + 2),
        bytes_accessed=4 * (rows * (2 * dk + 2 * dv + 2) + 2 * states * heads * dk * dv),
    )
