"""The XLA ragged paged attention backends (the reference and the CPU-shaped `xla` one) against
a dense per-request computation in numpy.

Unused pages are filled with NaN, so any read outside a request's pages or past its length
poisons the output and fails the comparison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    QUANTIZED_KV_DTYPES,
    KVCache,
    get_kv_cache_shape,
    ragged_paged_attention,
    write_kv,
    zeros_kv_cache,
)
from pallas_kernels.kv_cache import dequantize_kv_cache, read_kv

from helpers import MIXES, dense_attention, make_case, quantize_case_cache, shape_matrix

XLA_BACKENDS = ("reference", "xla", "cpu")


_DENSE_CONFIGS = [
    (4, 4, 64, 16, jnp.float32),
    (6, 2, 128, 16, jnp.float32),
    (8, 1, 64, 128, jnp.float32),
    (6, 2, 64, 16, jnp.bfloat16),
]


@pytest.mark.parametrize("backend", XLA_BACKENDS)
@pytest.mark.parametrize(
    "config,mix",
    shape_matrix(_DENSE_CONFIGS, lambda c: "-".join(map(str, c[:4])) + f"-{c[4].dtype.name}"),
)
def test_matches_dense(backend, config, mix):
    num_heads, num_kv_heads, head_dim, page_size, dtype = config
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
        backend=backend,
    )
    out = np.asarray(out.astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for r, (q_len, _) in enumerate(seqs):
        expect = dense_attention(q[cu[r] : cu[r + 1]], ks[r], vs[r], q_len, sm_scale)
        np.testing.assert_allclose(
            out[cu[r] : cu[r + 1]], expect, atol=tol, rtol=tol, err_msg=f"request {r}"
        )
    assert np.all(out[total:] == 0), "padding rows must read nothing"


@pytest.mark.parametrize("backend", XLA_BACKENDS)
@pytest.mark.parametrize("sliding_window,soft_cap", [(7, None), (None, 5.0), (32, 30.0)])
def test_sliding_window_and_soft_cap(backend, sliding_window, soft_cap):
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
            backend=backend,
        )
    )
    for r, (q_len, _) in enumerate(seqs):
        expect = dense_attention(
            q[cu[r] : cu[r + 1]], ks[r], vs[r], q_len, 0.125, sliding_window, soft_cap
        )
        np.testing.assert_allclose(out[cu[r] : cu[r + 1]], expect, atol=1e-5, rtol=1e-5)


def _mixed(backend: str, seed: int, *, num_heads=6, head_dim=64, sm_scale=0.125, **kwargs):
    """The "mixed" batch (f32, 2 kv heads, pages of 16) through `backend` with `kwargs`:
    (output, a function giving request r's dense truth for dense_attention's keywords)."""
    seqs = MIXES["mixed"]
    q, cache, seq_lens, bt, cu, _, ks, vs, total = make_case(
        np.random.default_rng(seed), seqs, num_heads=num_heads, num_kv_heads=2,
        head_dim=head_dim, page_size=16, max_reqs=8, t_pad=64, dtype=jnp.float32,
    )  # fmt: skip
    args = (q, cache, 1, seq_lens, bt, cu, [len(seqs)])
    out = ragged_paged_attention(
        *(jnp.asarray(a, jnp.int32 if i > 1 else None) for i, a in enumerate(args)),
        sm_scale=sm_scale, backend=backend, **kwargs,
    )  # fmt: skip
    out = np.asarray(out)
    assert np.all(out[total:] == 0), "padding rows must read nothing"

    def truth(r: int, **dense) -> np.ndarray:
        rows = slice(cu[r], cu[r + 1])
        return dense_attention(q[rows], ks[r], vs[r], seqs[r][0], sm_scale, **dense)

    return out, [slice(cu[r], cu[r + 1]) for r in range(len(seqs))], truth


@pytest.mark.parametrize("backend", XLA_BACKENDS)
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_attention_sinks(backend, sliding_window):
    """gpt-oss's sinks: a logit per head in each softmax's denominator, large and small against
    the scores (a head that mostly attends to nothing, and one that barely notices), equal to
    transformers' way (one more column, dropped after the softmax)."""
    sinks = np.array([-3.0, 0.0, 0.5, 2.0, 6.0, -40.0], np.float32)
    kwargs = dict(sliding_window=sliding_window)
    out, rows, truth = _mixed(backend, 3, sinks=jnp.asarray(sinks), **kwargs)
    for r, at in enumerate(rows):
        expect = truth(r, sinks=sinks, **kwargs)
        np.testing.assert_allclose(out[at], expect, atol=1e-5, rtol=1e-5)
        assert not np.allclose(expect, truth(r, **kwargs), atol=1e-3), "sinks must count"


@pytest.mark.parametrize("backend", XLA_BACKENDS)
@pytest.mark.parametrize("chunk,sliding_window", [(20, None), (37, 9), (1, None)])
def test_chunked_attention(backend, chunk, sliding_window):
    """Llama 4's chunked attention: each query sees its own chunk's keys only (with a window
    besides, and chunks of one token: each query itself), over contexts of several chunks."""
    out, rows, truth = _mixed(backend, 4, sliding_window=sliding_window, attention_chunk=chunk)
    assert max(kv for _, kv in MIXES["mixed"]) > 2 * 37
    for r, at in enumerate(rows):
        expect = truth(r, sliding_window=sliding_window, chunk=chunk)
        np.testing.assert_allclose(out[at], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", XLA_BACKENDS)
def test_head_dim_512(backend):
    """Gemma 4's full-attention heads of 512 (the C++ kernel's generic head size)."""
    out, rows, truth = _mixed(backend, 5, num_heads=4, head_dim=512, sm_scale=0.05)
    for r, at in enumerate(rows):
        np.testing.assert_allclose(out[at], truth(r), atol=1e-5, rtol=1e-5)


def test_write_kv_writes_only_its_slots():
    shape = get_kv_cache_shape(3, 4, 8, 2, 16)
    cache = jnp.zeros(shape)
    k = jnp.ones((5, 2, 16))
    v = 2 * jnp.ones((5, 2, 16))
    num_slots = 4 * 8
    slots = jnp.array([0, 9, 31, num_slots, num_slots], jnp.int32)  # two padding tokens
    out = np.asarray(write_kv(cache, 1, k, v, slots))
    assert np.all(out[0] == 0) and np.all(out[2] == 0), "other layers must be untouched"
    # [pages, K, page_size, 2H] -> one row per slot: [slot, K, 2H] (the key, then the value)
    flat = out[1].transpose(0, 2, 1, 3).reshape(num_slots, 2, 32)
    for s in (0, 9, 31):
        assert np.all(flat[s, :, :16] == 1) and np.all(flat[s, :, 16:] == 2)
    others = np.delete(flat, [0, 9, 31], axis=0)
    assert np.all(others == 0)


# The largest error an 8-bit cache adds to the attention output of `make_case`'s unit-normal
# K/V, against float: int8 keeps 8 bits of each token's range, e4m3 3 mantissa bits.
KV_QUANT_TOL = {"int8": 3e-2, "fp8": 0.25}


@pytest.mark.parametrize("backend", XLA_BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_matches_dequantized(backend, kv_dtype):
    """An 8-bit cache gives the attention of its dequantized values, exactly up to float
    rounding (reference: the dequantized float cache; unused slots still NaN), and that stays
    close to the float K/V it was made from."""
    rng = np.random.default_rng(5)
    seqs = MIXES["mixed"]
    q, cache, seq_lens, bt, cu, _, ks, vs, total = make_case(
        rng,
        seqs,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        max_reqs=8,
        t_pad=64,
        dtype=jnp.float32,
    )
    quant = quantize_case_cache(cache, QUANTIZED_KV_DTYPES[kv_dtype])
    dequant = dequantize_kv_cache(quant)
    meta = (jnp.int32(1), jnp.asarray(seq_lens), jnp.asarray(bt), jnp.asarray(cu))
    meta = (*meta, jnp.asarray([len(seqs)], jnp.int32))
    out = np.asarray(
        ragged_paged_attention(jnp.asarray(q), quant, *meta, sm_scale=0.125, backend=backend)
    )
    want = np.asarray(
        ragged_paged_attention(jnp.asarray(q), dequant, *meta, sm_scale=0.125, backend="reference")
    )
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out[:total], want[:total], atol=2e-5, rtol=2e-5)
    assert np.all(out[total:] == 0)
    for r, (q_len, _) in enumerate(seqs):
        expect = dense_attention(q[cu[r] : cu[r + 1]], ks[r], vs[r], q_len, 0.125)
        err = np.abs(out[cu[r] : cu[r + 1]] - expect).max()
        assert err < KV_QUANT_TOL[kv_dtype], (r, err)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_write_kv_quantizes_per_token_and_head(kv_dtype):
    """Each written K or V head of a token gets its own scale (its absolute maximum over the
    format's largest value, so that element is exact) and lands in its slot; padding slots and
    other layers stay untouched."""
    num_slots = 4 * 8
    cache = zeros_kv_cache(get_kv_cache_shape(3, 4, 8, 2, 16), kv_dtype)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((5, 2, 16)).astype(np.float32) * np.array([1, 100])[None, :, None]
    v = rng.standard_normal((5, 2, 16)).astype(np.float32) * 1e-3
    slots = jnp.array([0, 9, 31, num_slots, num_slots + 7], jnp.int32)  # two padding tokens
    out = write_kv(cache, 1, jnp.asarray(k), jnp.asarray(v), slots)
    assert isinstance(out, KVCache) and out.dtype == kv_dtype
    data, scales = np.asarray(out.data.astype(jnp.float32)), np.asarray(out.scales)
    assert not data[[0, 2]].any() and not scales[[0, 2]].any(), "other layers are untouched"
    got = np.asarray(read_kv(out, 1, jnp.arange(4))).reshape(num_slots, 4, 16)
    tol = {jnp.int8: 0.5 / 127, jnp.float8_e4m3fn: 1 / 16}[kv_dtype]
    for i, s in enumerate((0, 9, 31)):
        want = np.stack([k[i], v[i]], axis=1).reshape(4, 16)
        amax = np.abs(want).max(-1, keepdims=True)
        assert np.all(np.abs(got[s] - want) <= tol * amax + 1e-12), s
        assert np.allclose(np.abs(got[s]).max(-1), amax[:, 0], rtol=1e-6)  # the max is exact
    # In place under jit with the cache donated: no temporary could hold a copy of the data (a
    # float8 array would be widened for the scatter on CPU; it is stored as bytes instead).
    write = jax.jit(write_kv, static_argnums=1, donate_argnums=0)
    memory = write.lower(cache, 1, jnp.asarray(k), jnp.asarray(v), slots).compile()
    memory = memory.memory_analysis()
    assert memory.alias_size_in_bytes == cache.nbytes
    assert memory.temp_size_in_bytes < cache.data.nbytes // 2, memory
    written = np.zeros(num_slots, bool)
    written[[0, 9, 31]] = True
    assert (
        not got[~written].any()
        and not scales[1].reshape(4, 4, 8).transpose(0, 2, 1).reshape(32, 4)[~written].any()
    )


def test_bad_shapes_are_named():
    q = jnp.zeros((16, 4, 64))
    args = (jnp.zeros(8, jnp.int32), jnp.zeros((8, 4), jnp.int32))
    with pytest.raises(ValueError, match="needs float32 scales"):
        ragged_paged_attention(
            q,
            KVCache(jnp.zeros((1, 4, 16, 8, 64), jnp.int8)),
            0,
            *args,
            jnp.zeros(9, jnp.int32),
            jnp.ones(1, jnp.int32),
            sm_scale=1.0,
        )
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


def test_loading_the_cpu_kernel_keeps_subnormals():
    """Built with -ffast-math at link time, the native kernel's library turned on flush-to-zero
    for the whole process when it loaded (found by the fuzz suite's float strategies), so
    numpy and XLA silently lost their subnormal numbers."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from pallas_kernels import ragged_attention_cpu as k\n"
        "if not k.available(): raise SystemExit(3)\n"
        "assert np.float32(1e-40) * np.float32(1.0) != 0, 'subnormals flushed to zero'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip("no C++ compiler builds the native CPU kernel here")
    assert proc.returncode == 0, proc.stderr[-2000:]
