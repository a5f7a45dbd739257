"""The reference ragged paged attention against a dense per-request computation in numpy.

Unused pages are filled with NaN, so any read outside a request's pages or past its length
poisons the output and fails the comparison."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import get_kv_cache_shape, ragged_paged_attention, write_kv


def dense_attention(q, k, v, q_len, sm_scale, sliding_window=None, soft_cap=None):
    """q: [q_len, N, H]; k, v: [kv_len, K, H]; the queries are the last q_len positions."""
    kv_len, num_kv, _ = k.shape
    group = q.shape[1] // num_kv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qnh,knh->nqk", q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    pos = np.arange(kv_len - q_len, kv_len)[:, None]
    kpos = np.arange(kv_len)[None, :]
    mask = kpos <= pos
    if sliding_window is not None:
        mask &= kpos > pos - sliding_window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqk,knh->qnh", p, v)


def make_case(rng, seqs, *, num_heads, num_kv_heads, head_dim, page_size, max_reqs, t_pad, dtype):
    """seqs: list of (q_len, kv_len). Builds a NaN-filled cache holding each request's K/V in
    shuffled pages, and the padded metadata arrays."""
    pages_per_seq = max(-(-kv // page_size) for _, kv in seqs) + 1
    num_pages = sum(-(-kv // page_size) for _, kv in seqs) + 3
    # Two layers; the request data lives in layer 1 and everything else is NaN, so reading the
    # wrong layer, a page outside the block table, or a slot past the length poisons the output.
    cache = np.full(
        get_kv_cache_shape(2, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32
    )
    perm = rng.permutation(num_pages)
    block_tables = np.zeros((max_reqs, pages_per_seq), np.int32)
    seq_lens = np.zeros(max_reqs, np.int32)
    cu = np.zeros(max_reqs + 1, np.int32)
    qs, ks, vs = [], [], []
    used = 0
    for r, (q_len, kv_len) in enumerate(seqs):
        n = -(-kv_len // page_size)
        pages = perm[used : used + n]
        used += n
        block_tables[r, :n] = pages
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
        for t in range(kv_len):
            page, off = pages[t // page_size], t % page_size
            cache[1, page, off, 0::2] = k[t]
            cache[1, page, off, 1::2] = v[t]
        qs.append(rng.standard_normal((q_len, num_heads, head_dim)).astype(np.float32))
        ks.append(k)
        vs.append(v)
        seq_lens[r] = kv_len
        cu[r + 1] = cu[r] + q_len
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    total = int(cu[len(seqs)])
    q = np.full((t_pad, num_heads, head_dim), 0.5, np.float32)  # padding rows: arbitrary
    q[:total] = np.concatenate(qs)
    # Round inputs to the dtype so the f32 numpy reference sees the same values.
    q = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32))
    cache = np.asarray(jnp.asarray(cache, dtype).astype(jnp.float32))
    ks = [np.asarray(jnp.asarray(k, dtype).astype(jnp.float32)) for k in ks]
    vs = [np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)) for v in vs]
    return q, cache, seq_lens, block_tables, cu, qs, ks, vs, total


MIXES = {
    "decode": [(1, 1), (1, 17), (1, 255), (1, 513), (1, 3)],
    "prefill": [(3, 3), (16, 16), (17, 17), (255, 255)],
    "chunked": [(16, 513), (3, 17), (17, 255)],
    "mixed": [(1, 513), (17, 17), (16, 255), (1, 1), (3, 16)],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,page_size,dtype",
    [
        (4, 4, 64, 16, jnp.float32),
        (6, 2, 128, 16, jnp.float32),
        (8, 1, 64, 128, jnp.float32),
        (6, 2, 64, 16, jnp.bfloat16),
    ],
)
def test_matches_dense(mix, num_heads, num_kv_heads, head_dim, page_size, dtype):
    rng = np.random.default_rng(0)
    seqs = MIXES[mix]
    q, cache, seq_lens, bt, cu, _, ks, vs, total = make_case(
        rng,
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_reqs=8,
        t_pad=512,
        dtype=dtype,
    )
    sm_scale = head_dim**-0.5
    out = ragged_paged_attention(
        jnp.asarray(q, dtype),
        jnp.asarray(cache, dtype),
        1,
        jnp.asarray(seq_lens),
        jnp.asarray(bt),
        jnp.asarray(cu),
        jnp.asarray([len(seqs)], jnp.int32),
        sm_scale=sm_scale,
    )
    out = np.asarray(out.astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for r, (q_len, _) in enumerate(seqs):
        expect = dense_attention(q[cu[r] : cu[r + 1]], ks[r], vs[r], q_len, sm_scale)
        np.testing.assert_allclose(
            out[cu[r] : cu[r + 1]], expect, atol=tol, rtol=tol, err_msg=f"request {r}"
        )
    assert np.all(out[total:] == 0), "padding rows must read nothing"


@pytest.mark.parametrize("sliding_window,soft_cap", [(7, None), (None, 5.0), (32, 30.0)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(1)
    seqs = MIXES["mixed"]
    q, cache, seq_lens, bt, cu, _, ks, vs, _ = make_case(
        rng,
        seqs,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        max_reqs=8,
        t_pad=64,
        dtype=jnp.float32,
    )
    out = np.asarray(
        ragged_paged_attention(
            jnp.asarray(q),
            jnp.asarray(cache),
            jnp.int32(1),
            jnp.asarray(seq_lens),
            jnp.asarray(bt),
            jnp.asarray(cu),
            jnp.asarray([len(seqs)], jnp.int32),
            sm_scale=0.125,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    )
    for r, (q_len, _) in enumerate(seqs):
        expect = dense_attention(
            q[cu[r] : cu[r + 1]], ks[r], vs[r], q_len, 0.125, sliding_window, soft_cap
        )
        np.testing.assert_allclose(out[cu[r] : cu[r + 1]], expect, atol=1e-5, rtol=1e-5)


def test_write_kv_writes_only_its_slots():
    shape = get_kv_cache_shape(3, 4, 8, 2, 16)
    cache = jnp.zeros(shape)
    k = jnp.ones((5, 2, 16))
    v = 2 * jnp.ones((5, 2, 16))
    num_slots = 4 * 8
    slots = jnp.array([0, 9, 31, num_slots, num_slots], jnp.int32)  # two padding tokens
    out = np.asarray(write_kv(cache, 1, k, v, slots))
    assert np.all(out[0] == 0) and np.all(out[2] == 0), "other layers must be untouched"
    flat = out[1].reshape(num_slots, 4, 16)
    for s in (0, 9, 31):
        assert np.all(flat[s, 0::2] == 1) and np.all(flat[s, 1::2] == 2)
    others = np.delete(flat, [0, 9, 31], axis=0)
    assert np.all(others == 0)


def test_bad_shapes_are_named():
    q = jnp.zeros((16, 4, 64))
    args = (jnp.zeros(8, jnp.int32), jnp.zeros((8, 4), jnp.int32))
    with pytest.raises(ValueError, match="kv heads"):
        ragged_paged_attention(
            q, jnp.zeros(get_kv_cache_shape(1, 4, 16, 3, 64)), 0, *args,
            jnp.zeros(9, jnp.int32), jnp.zeros(1, jnp.int32), sm_scale=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(
            q, jnp.zeros(get_kv_cache_shape(1, 4, 16, 2, 64)), 0, *args,
            jnp.zeros(8, jnp.int32), jnp.zeros(1, jnp.int32), sm_scale=1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache must be"):
        ragged_paged_attention(
            q, jnp.zeros((4, 16, 4, 64)), 0, *args,
            jnp.zeros(9, jnp.int32), jnp.zeros(1, jnp.int32), sm_scale=1.0,
        )  # fmt: skip
