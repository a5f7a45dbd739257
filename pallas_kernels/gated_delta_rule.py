"""The gated delta rule (Gated DeltaNet's recurrence) over a ragged batch: three forms.

Per value head, with S [key dim, value dim] the request's state and each token's q and k
L2-normalised (q scaled), g its log-decay and b its write strength:

    S = exp(g) S;  u = b (v - S^T k);  S += k u^T;  o = S^T q

A step's tokens are a ragged batch (`cu_q_lens`, as the attention kernels take it): a request's
tokens are contiguous, a prefill chunk or one decode token. Each request starts from its row of
`initial` and ends in its row of the returned state (a request with no token keeps its row).

- "reference": the recurrence itself, token by token (every request's first token in one
  batched update, then the chunks' further tokens one at a time). Its loop runs once per
  prefill token: on a GPU, XLA's `while` with a trip count known only on the device copies the
  predicate to the host every iteration.
- "chunked": the chunked, parallel-within-chunk form (the WY representation, as in
  flash-linear-attention's `chunk_gated_delta_rule` and vLLM's and sglang-jax's GDN backends),
  in XLA. A chunk of C tokens of one request is a handful of [C, C] and [C, D] matmuls: with
  G the chunk's cumulative log-decay, D_ij = exp(G_i - G_j) for j <= i, and S0 the state
  entering it,

      A  = strictly-lower(b_i (k_i . k_j) D_ij),  T = (I + A)^-1
      U  = T (b v) - T (b exp(G) k) S0          (the chunk's u's, all at once)
      O  = exp(G) q S0 + lower(q_i . k_j D_ij) U
      S  = exp(G_C) S0 + (exp(G_C - G) k)^T U

  Decode rows (and every request's first token) go through the batched one-token update as in
  the reference; the loop then runs once per chunk of C prefill tokens instead of per token.
  It is the form for the CPU (and for a TPU whose attention backend is "xla": XLA:TPU runs
  the loop on the device, its trip count costing nothing). T is forward substitution on 16-row diagonal blocks, merged in pairs (`_blocked_inverse`).
- "pallas_gpu": the same chunk algebra in a Pallas kernel for NVIDIA GPUs (Triton lowering),
  grid (request, value head, value block): each program walks its request's chunks in order
  with its [key dim, value block] share of the state in registers; a decode row takes the
  one-token update instead. No loop is left to XLA, so no step syncs with the host. T is
  forward substitution over the whole chunk (Triton cannot slice a block out of a value).
- "pallas_tpu": the chunk algebra in a Mosaic kernel for TPUs (`gated_delta_rule_tpu.py`),
  after the batched one-token update as the chunked form: one program per value head walks
  the step's chunks with the head's state in VMEM, its rows fetched by DMA straight from the
  token-major inputs, double-buffered. T is blocked inversion by doubling, on whole matrices.

The chunked forms invert by substitution or by exact block inverses, stable where the Neumann
series (I - A + A^2 ...) is not: keys at nearby positions can be nearly parallel, and A's
powers then grow binomially.

All four take q and k already normalised and scaled, and float32 inputs; the model's layer
(`jaxllm.models.linear_attention`) does that and zeroes the state of fresh requests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.delta_rule_chunk import chunk_algebra, pad_to, token_rows
from pallas_kernels.gated_delta_rule_tpu import gated_delta_rule_rest
from pallas_kernels.quant_matmul_gpu import MIN_DOT
from pallas_kernels.target import current_platform

GDN_BACKENDS = ("reference", "chunked", "pallas_gpu", "pallas_tpu")
CHUNK = 64  # tokens per chunk, as flash-linear-attention's kernels take them
_HIGHEST = jax.lax.Precision.HIGHEST


def gated_delta_rule(
    q: jax.Array,  # f32[T, H, Dk], L2-normalised and scaled
    k: jax.Array,  # f32[T, H, Dk], L2-normalised
    v: jax.Array,  # f32[T, H, Dv]
    g: jax.Array,  # f32[T, H] log-decay (<= 0)
    beta: jax.Array,  # f32[T, H]
    initial: jax.Array,  # f32[R, H, Dk, Dv]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]: requests past it are padding (no tokens)
    *,
    backend: str = "chunked",
    chunk: int = CHUNK,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(o f32[T, H, Dv], the state after each request's tokens f32[R, H, Dk, Dv]). Tokens past
    the last request's give zeros."""
    if backend not in GDN_BACKENDS:
        raise ValueError(f"gated delta rule backend must be one of {GDN_BACKENDS}, got {backend!r}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    q, k, v, g, beta, initial = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, initial))
    cu_q_lens = jnp.asarray(cu_q_lens, jnp.int32)
    num_reqs = initial.shape[0]
    live = jnp.arange(num_reqs) < jnp.asarray(num_seqs).reshape(-1)[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    starts = cu_q_lens[:-1]
    if backend == "pallas_gpu":
        return _pallas_gpu(q, k, v, g, beta, initial, starts, q_lens, chunk, interpret)
    o_first, final = _first_tokens(q, k, v, g, beta, initial, starts, q_lens)
    if backend == "reference":
        return _reference_rest(q, k, v, g, beta, final, o_first, starts, q_lens)
    if backend == "pallas_tpu":
        if interpret is None:
            interpret = current_platform() != "tpu"
        return gated_delta_rule_rest(
            q, k, v, g, beta, final, o_first, starts, q_lens, chunk=chunk, interpret=interpret
        )
    return _chunked_rest(q, k, v, g, beta, final, o_first, starts, q_lens, chunk)


def _update(s, q_t, k_t, v_t, g_t, b_t):
    """One token's step on a state s [..., H, Dk, Dv]: (the new state, the output [..., H,
    Dv])."""
    s = s * jnp.exp(g_t)[..., None, None]
    memory = jnp.einsum("...hkv,...hk->...hv", s, k_t, precision=_HIGHEST)
    delta = (v_t - memory) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("...hkv,...hk->...hv", s, q_t, precision=_HIGHEST)


def _first_tokens(q, k, v, g, beta, initial, starts, q_lens):
    """Every request's first token in one batched update (a decode step is only this): (o
    f32[T, H, Dv] with those tokens' outputs, each request's state after it)."""
    num_tokens = q.shape[0]
    first = jnp.minimum(starts, num_tokens - 1)
    after, o_first = _update(initial, q[first], k[first], v[first], g[first], beta[first])
    has_token = q_lens > 0
    final = jnp.where(has_token[:, None, None, None], after, initial)
    out = jnp.zeros(v.shape, jnp.float32)
    out = out.at[jnp.where(has_token, first, num_tokens)].set(o_first, mode="drop")
    return out, final


def _reference_rest(q, k, v, g, beta, final, out, starts, q_lens):
    """The tokens past each request's first, one at a time, in order."""
    request, index, rest = token_rows(starts, q_lens, q.shape[0])
    order = jnp.argsort(~rest, stable=True)

    def body(i, carry):
        s, final, out = carry
        t = order[i]
        r = request[t]
        s = jnp.where(index[t] == 1, final[r], s)  # its first token's state
        s, o_t = _update(s, q[t], k[t], v[t], g[t], beta[t])
        out = jax.lax.dynamic_update_index_in_dim(out, o_t, t, 0)
        final = jax.lax.dynamic_update_index_in_dim(final, s, r, 0)
        return s, final, out

    _, final, out = jax.lax.fori_loop(0, jnp.sum(rest), body, (final[0], final, out))
    return out, final


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower-triangular a [C, C], by forward substitution, row by
    row: row i of the inverse is e_i - a_i (its rows before i). Elementwise ops and sums only:
    Triton has no triangular solve (and XLA's, `solve_triangular`, hung XLA:CPU inside the
    chunk loop, a `while`: jax 0.10.2, 2 cores)."""
    c = a.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    inverse = (rows == jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)).astype(a.dtype)

    def body(i, inverse):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C], zero from column i on
        row = jnp.sum(a_i[:, None] * inverse, axis=0)
        return inverse - jnp.where(rows == i, row[None, :], 0.0)

    return jax.lax.fori_loop(1, c, body, inverse)


def _blocked_inverse(a, base: int = 16):
    """(I + a)^-1 as `_unit_lower_inverse` computes it, in fewer sequential steps (XLA's loops
    cost per trip on a CPU, and a chunk's 63 trips cost more than its matmuls there): forward
    substitution on the diagonal blocks of `base` rows, then pairs of blocks merged,
    [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], until the block is whole. Every
    step is the exact inverse of a smaller block: as stable as forward substitution."""
    c = a.shape[0]
    diagonal = jnp.stack([a[i : i + base, i : i + base] for i in range(0, c, base)])
    # One loop of base - 1 trips for all blocks (unrolled, it ran 1.1-1.5x faster on a 2-core
    # CPU and compiled the hybrid tests' programs 1.4x slower).
    blocks = list(jax.vmap(_unit_lower_inverse)(diagonal))
    size = base
    while len(blocks) > 1:
        merged = []
        for pair in range(0, len(blocks), 2):
            upper, lower = blocks[pair], blocks[pair + 1]
            rows, cols = (pair + 1) * size, pair * size
            off = a[rows : rows + size, cols : cols + size]
            corner = -_xla_dot(_xla_dot(lower, off, False, False), upper, False, False)
            top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=1)
            merged.append(jnp.concatenate([top, jnp.concatenate([corner, lower], 1)], axis=0))
        blocks, size = merged, 2 * size
    return blocks[0]


def _xla_dot(x, y, trans_a, trans_b):
    return jnp.dot(x.T if trans_a else x, y.T if trans_b else y, precision=_HIGHEST)


def _chunked_rest(q, k, v, g, beta, final, out, starts, q_lens, chunk):
    """The tokens past each request's first, a chunk of `chunk` tokens of one request per
    iteration, all heads at once."""
    num_tokens, num_heads = q.shape[:2]
    rest = jnp.maximum(q_lens - 1, 0)
    per_request = (rest + chunk - 1) // chunk
    cu_chunks = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_request)])
    pad = ((0, chunk),) + ((0, 0),) * (q.ndim - 1)
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    g, beta = (jnp.pad(x, pad[:2])[..., None] for x in (g, beta))  # columns per head
    out = jnp.pad(out, pad)
    algebra = jax.vmap(
        functools.partial(chunk_algebra, dot=_xla_dot, invert=_blocked_inverse),
        in_axes=(0, 1, 1, 1, 1, 1),
        out_axes=(1, 0),
    )

    def body(n, carry):
        final, out = carry
        r = jnp.minimum(
            jnp.searchsorted(cu_chunks[1:], n, side="right", method="compare_all"),
            starts.shape[0] - 1,
        )
        offset = (n - cu_chunks[r]) * chunk
        begin = starts[r] + 1 + offset
        ok = jnp.arange(chunk) < rest[r] - offset  # [C]

        def rows(x):
            x = jax.lax.dynamic_slice_in_dim(x, begin, chunk, 0)
            return jnp.where(ok.reshape((chunk,) + (1,) * (x.ndim - 1)), x, 0.0)

        o, s = algebra(final[r], *(rows(x) for x in (q, k, v, g, beta)))
        window = jax.lax.dynamic_slice_in_dim(out, begin, chunk, 0)
        out = jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(ok[:, None, None], o, window), begin, 0
        )
        return jax.lax.dynamic_update_index_in_dim(final, s, r, 0), out

    final, out = jax.lax.fori_loop(0, cu_chunks[-1], body, (final, out))
    return out[:num_tokens], final


def _triton_dot(x, y, trans_a, trans_b):
    return pltriton.dot(x, y, trans_a=trans_a, trans_b=trans_b, allow_tf32=False)


def _gpu_kernel(
    starts_ref,  # i32[R]
    q_lens_ref,  # i32[R]
    q_ref,  # f32[T + C, H, Dk']
    k_ref,  # f32[T + C, H, Dk']
    v_ref,  # f32[T + C, H, Dv']
    g_ref,  # f32[T + C, H]
    b_ref,  # f32[T + C, H]
    s0_ref,  # f32[R, H, Dk', Dv']
    zeros_ref,  # f32[T + C, H, Dv'], aliased to o_ref (rows no request owns stay zero)
    o_ref,  # f32[T + C, H, Dv']
    s_ref,  # f32[R, H, Dk', Dv']
    *,
    chunk: int,
    block_v: int,
):
    del zeros_ref
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, q_len = starts_ref[r], q_lens_ref[r]
    cols = pl.ds(vb * block_v, block_v)
    s0 = s0_ref[r, h, :, cols]  # [Dk', BV]

    def decode(s):
        q, k = q_ref[start, h, :], k_ref[start, h, :]  # [Dk']
        v, g, b = v_ref[start, h, cols], g_ref[start, h], b_ref[start, h]
        s = s * jnp.exp(g)
        delta = (v - jnp.sum(s * k[:, None], axis=0)) * b
        s = s + k[:, None] * delta[None, :]
        o_ref[start, h, cols] = jnp.sum(s * q[:, None], axis=0)
        return s

    def prefill(s):
        def body(n, s):
            begin = start + n * chunk
            ok = jnp.arange(chunk, dtype=jnp.int32) < q_len - n * chunk  # [C]

            def rows(ref, *last):
                x = ref[(pl.ds(begin, chunk), h, *last)]
                return jnp.where(ok.reshape((chunk,) + (1,) * (x.ndim - 1)), x, 0.0)

            q, k, v = rows(q_ref, slice(None)), rows(k_ref, slice(None)), rows(v_ref, cols)
            g, b = rows(g_ref)[:, None], rows(b_ref)[:, None]
            o, s = chunk_algebra(s, q, k, v, g, b, dot=_triton_dot, invert=_unit_lower_inverse)
            pltriton.store(o_ref.at[pl.ds(begin, chunk), h, cols], o, mask=ok[:, None])
            return s

        return jax.lax.fori_loop(0, (q_len + chunk - 1) // chunk, body, s)

    s_ref[r, h, :, cols] = jax.lax.cond(q_len == 1, decode, prefill, s0)


def _pallas_gpu(q, k, v, g, beta, initial, starts, q_lens, chunk, interpret):
    """The Triton kernel's call: dimensions padded to powers of two (zeros change nothing: a
    zero key or query channel adds nothing to a dot, a zero value channel stays zero), the
    tokens by one chunk (a request's last chunk may read past the batch)."""
    if interpret is None:
        interpret = current_platform() != "gpu"
    num_tokens, num_heads, dk = q.shape
    dv = v.shape[-1]
    dk_p, dv_p = (max(pl.next_power_of_2(d), MIN_DOT) for d in (dk, dv))
    block_v = min(dv_p, 64)

    tokens = num_tokens + chunk
    q, k = (pad_to(x, tokens, num_heads, dk_p) for x in (q, k))
    v = pad_to(v, tokens, num_heads, dv_p)
    g, beta = (pad_to(x, tokens, num_heads) for x in (g, beta))
    s0 = pad_to(initial, initial.shape[0], num_heads, dk_p, dv_p)
    kernel = functools.partial(_gpu_kernel, chunk=chunk, block_v=block_v)
    out, final = pl.pallas_call(
        kernel,
        grid=(initial.shape[0], num_heads, dv_p // block_v),
        out_shape=(
            jax.ShapeDtypeStruct((tokens, num_heads, dv_p), jnp.float32),
            jax.ShapeDtypeStruct(s0.shape, jnp.float32),
        ),
        input_output_aliases={8: 0},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gated_delta_rule_gpu",
    )(starts, q_lens, q, k, v, g, beta, s0, jnp.zeros((tokens, num_heads, dv_p), jnp.float32))
    return out[:num_tokens, :, :dv], final[:, :, :dk, :dv]
