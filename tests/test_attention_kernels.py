"""The Pallas ragged attention kernels against the reference backend.

One test class, `KernelCases`, runs every case for a backend. Its subclasses run it on CPU in
Pallas interpret mode (the bulk of the checking) and on a real TPU or GPU when one is present
(skipped otherwise, saying why). Unused pages and the tails of partial pages are NaN, so any
read past a request's length or outside its block table poisons the result.

Beyond interpret mode: a few targeted runs of the TPU kernel under the TPU simulator
(`pltpu.InterpretParams`: DMA and semaphore ordering, race detection, uninitialized scratch
filled with NaN), and lowering both kernels for their real platforms (Mosaic TPU, Triton
CUDA), which checks on this CPU what interpret mode cannot: that each op has a lowering.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import (
    BACKENDS,
    BlockSizes,
    get_block_sizes,
    get_kv_cache_shape,
    ragged_attention_cpu,
    ragged_paged_attention,
    resolve_backend,
)
from pallas_kernels.tuning import device_family

from helpers import MIXES, dense_attention, make_case, quantize_case_cache, shape_matrix

# (num_heads, num_kv_heads, head_dim, page_size, dtype): GQA ratios 1, 3 and 8, head_dim 64
# and 128, page sizes 16 and 128, f32 and bf16, each appearing with every mix (`shape_matrix`:
# the whole matrix under -m slow).
CONFIGS = [
    (2, 2, 128, 16, jnp.float32),
    (6, 2, 64, 16, jnp.bfloat16),
    (8, 1, 128, 128, jnp.bfloat16),
    (3, 1, 64, 128, jnp.float32),
]


def _case(rng, mix, num_heads, num_kv_heads, head_dim, page_size, dtype, *, max_reqs=8):
    seqs = MIXES[mix]
    total = sum(q for q, _ in seqs)
    t_pad = -(-(total + 5) // 16) * 16  # some padding rows past the last request
    q, cache, seq_lens, bt, cu, _, ks, vs, total = make_case(
        rng,
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_reqs=max_reqs,
        t_pad=t_pad,
        dtype=dtype,
    )
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(cache, dtype),
        jnp.int32(1),
        jnp.asarray(seq_lens),
        jnp.asarray(bt),
        jnp.asarray(cu),
        jnp.asarray([len(seqs)], jnp.int32),
    )
    return args, (q, cu, ks, vs, total)


def _tolerance(dtype, tf32: bool = False):
    # bf16: the kernels multiply bf16 probabilities into bf16 values, as TPU and GPU kernels do.
    # tf32: on an NVIDIA GPU, Triton's float32 dots (and XLA's, in the reference) round their
    # inputs to TF32's 10-bit mantissa.
    if dtype != jnp.float32:
        return 3e-2
    return 5e-3 if tf32 else 1e-5


class KernelCases:
    backend: str
    interpret: bool | pltpu.InterpretParams

    def run(self, args, **kwargs):
        return ragged_paged_attention(
            *args, backend=self.backend, interpret=self.interpret, **kwargs
        )

    def tol(self, dtype=jnp.float32) -> float:
        return _tolerance(dtype, tf32=self.backend == "pallas_gpu" and not self.interpret)

    @pytest.mark.parametrize(
        "config,mix", shape_matrix(CONFIGS, lambda c: f"n{c[0]}k{c[1]}h{c[2]}p{c[3]}")
    )
    def test_matches_reference(self, config, mix):
        *shape, dtype = config
        args, (q, cu, ks, vs, total) = _case(np.random.default_rng(0), mix, *shape, dtype)
        sm_scale = shape[2] ** -0.5
        out = self.run(args, sm_scale=sm_scale)
        ref = ragged_paged_attention(*args, sm_scale=sm_scale, backend="reference")
        out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        assert not np.isnan(out).any(), "NaN from an unused page or slot leaked into the output"
        tol = self.tol(dtype)
        np.testing.assert_allclose(out[:total], ref[:total], atol=tol, rtol=tol)
        assert np.all(out[total:] == 0), "padding rows must read nothing"
        # And the dense numpy ground truth, so the reference cannot be wrong in the same way.
        for r, (q_len, _) in enumerate(MIXES[mix]):
            expect = dense_attention(q[cu[r] : cu[r + 1]], ks[r], vs[r], q_len, sm_scale)
            np.testing.assert_allclose(out[cu[r] : cu[r + 1]], expect, atol=tol, rtol=tol)

    @pytest.mark.parametrize("sliding_window,soft_cap", [(7, None), (None, 5.0), (40, 30.0)])
    def test_sliding_window_and_soft_cap(self, sliding_window, soft_cap):
        args, (_, _, _, _, total) = _case(
            np.random.default_rng(1), "mixed", 6, 2, 64, 16, jnp.float32
        )
        kwargs = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
        out = np.asarray(self.run(args, **kwargs))
        ref = np.asarray(ragged_paged_attention(*args, **kwargs, backend="reference"))
        np.testing.assert_allclose(out[:total], ref[:total], atol=self.tol(), rtol=self.tol())

    @pytest.mark.parametrize("sliding_window", [None, 40])
    def test_attention_sinks(self, sliding_window):
        """gpt-oss's per-head sink logits, with and without a window, float and 8-bit caches."""
        args, (_, _, _, _, total) = _case(
            np.random.default_rng(7), "mixed", 6, 2, 64, 16, jnp.float32
        )
        sinks = jnp.asarray([-3.0, 0.0, 0.5, 2.0, 6.0, -40.0], jnp.float32)
        kwargs = dict(sm_scale=0.125, sliding_window=sliding_window, sinks=sinks)
        for case in (
            args,
            (args[0], quantize_case_cache(np.asarray(args[1]), jnp.int8), *args[2:]),
        ):
            out = np.asarray(self.run(case, **kwargs))
            ref = np.asarray(ragged_paged_attention(*case, **kwargs, backend="reference"))
            assert not np.isnan(out).any()
            np.testing.assert_allclose(out[:total], ref[:total], atol=self.tol(), rtol=self.tol())
            assert np.all(out[total:] == 0), "padding rows must read nothing"

    @pytest.mark.parametrize("chunk,sliding_window", [(20, None), (37, 9)])
    def test_chunked_attention(self, chunk, sliding_window):
        """Llama 4's chunked attention: chunks that start inside pages and query blocks."""
        args, (_, _, _, _, total) = _case(
            np.random.default_rng(9), "mixed", 6, 2, 64, 16, jnp.float32
        )
        kwargs = dict(sm_scale=0.125, sliding_window=sliding_window, attention_chunk=chunk)
        out = np.asarray(self.run(args, **kwargs))
        ref = np.asarray(ragged_paged_attention(*args, **kwargs, backend="reference"))
        assert not np.isnan(out).any()
        np.testing.assert_allclose(out[:total], ref[:total], atol=self.tol(), rtol=self.tol())
        assert np.all(out[total:] == 0), "padding rows must read nothing"

    def test_head_dim_512(self):
        """Gemma 4's full-attention heads of 512."""
        args, (_, _, _, _, total) = _case(
            np.random.default_rng(10), "mixed", 4, 2, 512, 16, jnp.float32
        )
        out = np.asarray(self.run(args, sm_scale=0.05))
        ref = np.asarray(ragged_paged_attention(*args, sm_scale=0.05, backend="reference"))
        np.testing.assert_allclose(out[:total], ref[:total], atol=self.tol(), rtol=self.tol())

    def test_block_sizes_do_not_change_the_result(self):
        """Blocks smaller and larger than a request, one page at a time or many."""
        args, (_, _, _, _, total) = _case(
            np.random.default_rng(2), "chunked", 6, 2, 64, 16, jnp.float32
        )
        ref = np.asarray(ragged_paged_attention(*args, sm_scale=0.1, backend="reference"))
        for sizes in (BlockSizes(q_block=16, kv_pages=1), BlockSizes(q_block=64, kv_pages=8)):
            out = np.asarray(self.run(args, sm_scale=0.1, block_sizes=sizes))
            np.testing.assert_allclose(out[:total], ref[:total], atol=self.tol(), rtol=self.tol())

    @pytest.mark.parametrize(
        "kv_dtype,config",
        [(jnp.int8, CONFIGS[1]), (jnp.float8_e4m3fn, CONFIGS[2])],
        ids=["int8-gqa3-p16", "fp8-gqa8-p128"],
    )
    def test_quantized_cache_matches_reference(self, kv_dtype, config):
        """An 8-bit cache (scales NaN in unused slots): the kernel widens it in q's dtype and
        applies the scales to scores and probabilities; the reference dequantizes pages."""
        *shape, dtype = config
        args, (_, _, _, _, total) = _case(np.random.default_rng(4), "mixed", *shape, jnp.float32)
        args = (
            args[0].astype(dtype),
            quantize_case_cache(np.asarray(args[1]), kv_dtype),
            *args[2:],
        )
        out = self.run(args, sm_scale=0.1)
        ref = ragged_paged_attention(*args, sm_scale=0.1, backend="reference")
        assert out.dtype == dtype
        out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        assert not np.isnan(out).any()
        tol = self.tol(dtype)
        np.testing.assert_allclose(out[:total], ref[:total], atol=tol, rtol=tol)
        assert np.all(out[total:] == 0)

    def test_no_valid_requests(self):
        """An all-padding batch (num_seqs = 0) returns zeros and reads nothing."""
        args, _ = _case(np.random.default_rng(3), "decode", 2, 2, 128, 16, jnp.float32)
        args = (*args[:-1], jnp.zeros(1, jnp.int32))
        out = np.asarray(self.run(args, sm_scale=0.1))
        assert np.all(out == 0)


def _attend_case(rng, sliding_window):
    """The "mixed" batch with blocks inside its prefill chunks whose tokens see each other
    (`attend_to` = the block's last position), some in several query blocks, and the dense
    numpy truth of every row."""
    args, (q, cu, ks, vs, total) = _case(rng, "mixed", 6, 2, 64, 16, jnp.float32)
    seq_lens = np.asarray(args[3])
    attend = np.full(args[0].shape[0], -1, np.int32)
    truth = np.zeros((total, 6, 64), np.float32)
    for r, (q_len, kv_len) in enumerate(MIXES["mixed"]):
        pos = np.arange(kv_len - q_len, kv_len)
        last = pos.copy()
        if q_len > 1:  # blocks [1, 1 + b) and the last third of the chunk
            b = min(5, q_len - 1)
            last[1 : 1 + b] = pos[b]
            tail = q_len - q_len // 3
            last[tail:] = pos[-1]
        attend[cu[r] : cu[r + 1]] = np.where(last > pos, last, -1)
        group = 3
        k, v = np.repeat(ks[r], group, axis=1), np.repeat(vs[r], group, axis=1)
        sc = np.einsum("qnh,knh->nqk", q[cu[r] : cu[r + 1]], k) * 0.125
        kpos = np.arange(seq_lens[r])[None, :]
        mask = kpos <= last[:, None]
        if sliding_window is not None:
            mask &= kpos > pos[:, None] - sliding_window
        sc = np.where(mask[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        truth[cu[r] : cu[r + 1]] = np.einsum("nqk,knh->qnh", p / p.sum(-1, keepdims=True), v)
    return args, jnp.asarray(attend), truth, total


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_attend_to_lets_a_block_see_itself(backend, sliding_window):
    """`attend_to`: the tokens of a block within a chunk see each other (Gemma 3's images),
    within the window behind each; the rest stays causal. Small blocks for the Pallas
    kernels, so a block spans several of their query blocks."""
    args, attend, truth, total = _attend_case(np.random.default_rng(5), sliding_window)
    kwargs = dict(sm_scale=0.125, sliding_window=sliding_window, attend_to=attend)
    if backend.startswith("pallas"):
        kwargs.update(interpret=True, block_sizes=BlockSizes(q_block=4, kv_pages=2))
    if backend == "cpu" and not ragged_attention_cpu.available():
        pytest.skip("the native cpu kernel could not be built")
    out = np.asarray(ragged_paged_attention(*args, backend=backend, **kwargs))
    np.testing.assert_allclose(out[:total], truth, atol=2e-5, rtol=2e-5)
    assert np.all(out[total:] == 0)
    # Without it, the same rows differ: the blocks were seen.
    kwargs.pop("attend_to")
    causal = np.asarray(ragged_paged_attention(*args, backend=backend, **kwargs))
    assert not np.allclose(causal[:total], truth, atol=1e-3)


class TestPallasTpuInterpret(KernelCases):
    backend, interpret = "pallas_tpu", True


class GpuKernelCases(KernelCases):
    @pytest.mark.parametrize(
        "mix,num_splits,sliding_window",
        [
            ("decode", 16, None),
            ("mixed", 4, 40),
            *(
                pytest.param(m, n, w, marks=pytest.mark.slow)
                for m in ("decode", "mixed")
                for n in (2, 4, 16)
                for w in (None, 40)
                if (m, n, w) not in (("decode", 16, None), ("mixed", 4, 40))
            ),
        ],
    )
    def test_split_kv_matches_reference(self, mix, num_splits, sliding_window):
        """Split-KV: each program's KV blocks in `num_splits` shares (more shares than a short
        sequence has blocks: empty ones), partial outputs combined, equal to the reference and
        to the unsplit kernel, with and without a window, and an 8-bit cache."""
        args, (_, _, _, _, total) = _case(np.random.default_rng(5), mix, 6, 2, 64, 16, jnp.float32)
        kwargs = dict(sm_scale=0.125, sliding_window=sliding_window)
        ref = np.asarray(ragged_paged_attention(*args, **kwargs, backend="reference"))
        q_block = 1 if mix == "decode" else 16
        one = BlockSizes(q_block=q_block, kv_pages=2)
        split = dataclasses.replace(one, num_splits=num_splits)
        out = np.asarray(self.run(args, **kwargs, block_sizes=split))
        assert not np.isnan(out).any()
        np.testing.assert_allclose(out[:total], ref[:total], atol=self.tol(), rtol=self.tol())
        assert np.all(out[total:] == 0)
        unsplit = np.asarray(self.run(args, **kwargs, block_sizes=one))
        np.testing.assert_allclose(out, unsplit, atol=1e-5, rtol=1e-5)
        quantized = (args[0], quantize_case_cache(np.asarray(args[1]), jnp.int8), *args[2:])
        ref8 = np.asarray(ragged_paged_attention(*quantized, **kwargs, backend="reference"))
        out8 = np.asarray(self.run(quantized, **kwargs, block_sizes=split))
        np.testing.assert_allclose(out8[:total], ref8[:total], atol=self.tol(), rtol=self.tol())
        # Sinks: folded into the combined splits (the splits' kernel does not see them).
        kwargs["sinks"] = jnp.linspace(-2.0, 3.0, 6, dtype=jnp.float32)
        ref_s = np.asarray(ragged_paged_attention(*args, **kwargs, backend="reference"))
        out_s = np.asarray(self.run(args, **kwargs, block_sizes=split))
        np.testing.assert_allclose(out_s[:total], ref_s[:total], atol=self.tol(), rtol=self.tol())


class TestPallasGpuInterpret(GpuKernelCases):
    backend, interpret = "pallas_gpu", True


@pytest.mark.skipif(
    jax.default_backend() != "tpu", reason="needs a TPU: the kernel runs natively only there"
)
class TestPallasTpuOnDevice(KernelCases):
    backend, interpret = "pallas_tpu", False


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs an NVIDIA GPU: the kernel runs natively only there",
)
class TestPallasGpuOnDevice(GpuKernelCases):
    backend, interpret = "pallas_gpu", False


@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_tpu_kernel_under_the_tpu_simulator(mix):
    """DMA/semaphore ordering and races, with uninitialized VMEM filled with NaN."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    seqs = MIXES[mix]
    args, (_, _, _, _, total) = _case(np.random.default_rng(4), mix, 4, 2, 64, 16, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    # Small blocks: many DMAs, both buffer slots, several requests per query block.
    out = ragged_paged_attention(
        *args,
        sm_scale=0.125,
        backend="pallas_tpu",
        interpret=params,
        block_sizes=BlockSizes(q_block=16, kv_pages=4),
    )
    out = np.asarray(out)
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found, "the simulator found a data race"
    ref = np.asarray(ragged_paged_attention(*args, sm_scale=0.125, backend="reference"))
    np.testing.assert_allclose(out[:total], ref[:total], atol=1e-5, rtol=1e-5)
    assert len(seqs) and np.all(out[total:] == 0)


def test_tpu_kernel_with_sinks_under_the_tpu_simulator():
    """The sinks' VMEM operand: no race, NaN-filled uninitialized memory never read."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    args, (_, _, _, _, total) = _case(np.random.default_rng(8), "mixed", 4, 2, 64, 16, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    kwargs = dict(sm_scale=0.125, sliding_window=9, sinks=jnp.asarray([1.0, -2.0, 0.0, 4.0]))
    out = ragged_paged_attention(
        *args, **kwargs, backend="pallas_tpu", interpret=params,
        block_sizes=BlockSizes(q_block=8, kv_pages=2),
    )  # fmt: skip
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found, "the simulator found a data race"
    ref = np.asarray(ragged_paged_attention(*args, **kwargs, backend="reference"))
    np.testing.assert_allclose(np.asarray(out)[:total], ref[:total], atol=1e-5, rtol=1e-5)


def test_tpu_kernel_with_attend_to_under_the_tpu_simulator():
    """The two operands `attend_to` adds (each item's key end in SMEM, each row's last key in
    VMEM): no race, NaN-filled uninitialized memory never read."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    args, attend, truth, total = _attend_case(np.random.default_rng(6), 7)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ragged_paged_attention(
        *args,
        sm_scale=0.125,
        sliding_window=7,
        attend_to=attend,
        backend="pallas_tpu",
        interpret=params,
        block_sizes=BlockSizes(q_block=4, kv_pages=2),
    )
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found, "the simulator found a data race"
    np.testing.assert_allclose(np.asarray(out)[:total], truth, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "backend,platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")], ids=["mosaic", "triton"]
)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,page_size,dtype,kv_dtype",
    [
        (9, 3, 64, 16, jnp.bfloat16, None),
        (32, 8, 128, 128, jnp.bfloat16, None),
        (8, 8, 128, 16, jnp.float32, None),
        (32, 8, 128, 16, jnp.bfloat16, jnp.int8),
        (9, 3, 64, 128, jnp.bfloat16, jnp.float8_e4m3fn),
    ],
)
def test_kernel_lowers_for_its_platform(
    backend, platform, num_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype
):
    args, _ = _case(
        np.random.default_rng(5), "mixed", num_heads, num_kv_heads, head_dim, page_size, dtype
    )
    if kv_dtype is not None:  # an 8-bit cache with its scales
        cache = np.asarray(args[1].astype(jnp.float32))
        args = (args[0], quantize_case_cache(cache, kv_dtype), *args[2:])
    sizes = get_block_sizes(
        backend,
        head_dim=head_dim,
        page_size=page_size,
        num_tokens=args[0].shape[0],
        max_reqs=8,
        device_kind="TPU v5 lite" if backend == "pallas_tpu" else "NVIDIA H100 80GB HBM3",
    )
    fn = functools.partial(
        ragged_paged_attention,
        sm_scale=0.125,
        sliding_window=64,
        soft_cap=30.0,
        sinks=jnp.linspace(-1.0, 1.0, num_heads, dtype=jnp.float32),
        attention_chunk=48,
        backend=backend,
        block_sizes=sizes,
        interpret=False,
    )
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if backend == "pallas_tpu" else "triton") in text


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") in ("cpu", "xla")
    assert resolve_backend("auto", "tpu") == "pallas_tpu"
    assert resolve_backend("auto", "gpu") == "pallas_gpu"
    assert resolve_backend("pallas", "cpu") == "pallas_tpu"  # interpreted
    assert resolve_backend("pallas", "gpu") == "pallas_gpu"
    assert resolve_backend("pallas_gpu", "cpu") == "pallas_gpu"
    with pytest.raises(ValueError, match="cannot run on platform"):
        resolve_backend("pallas_gpu", "tpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("flash", "cpu")


def test_tuning_table_lookup():
    assert device_family("TPU v5 lite") == "v5e"
    assert device_family("TPU v6 lite") == "v6e"
    assert device_family("TPU v5") == "v5p"
    assert device_family("NVIDIA H200") == "h200"
    assert device_family("some new chip") == "*"
    tpu = get_block_sizes(
        "pallas_tpu",
        head_dim=128,
        page_size=16,
        num_tokens=512,
        max_reqs=64,
        device_kind="TPU v6 lite",
    )
    assert tpu.kv_pages * 16 == 512
    # A GPU decode batch (one token per request) gets the smallest query block.
    decode = get_block_sizes(
        "pallas_gpu", head_dim=128, page_size=16, num_tokens=64, max_reqs=64, device_kind="H100"
    )
    prefill = get_block_sizes(
        "pallas_gpu", head_dim=128, page_size=16, num_tokens=512, max_reqs=8, device_kind="H100"
    )
    assert decode.q_block == 1 and prefill.q_block == 32
    # Decode and prefill take the H100's measured rows apart: long KV blocks with more warps
    # for one query per program, short ones under a query block.
    assert (decode.kv_pages * 16, decode.num_warps) == (256, 8)
    assert prefill.kv_pages * 16 == 32
    unknown = get_block_sizes(
        "pallas_gpu", head_dim=128, page_size=16, num_tokens=64, max_reqs=64, device_kind="L4"
    )
    assert (unknown.kv_pages * 16, unknown.num_warps) == (64, 4)  # the fallback row

    # Split-KV: a decode of few programs (requests x kv heads) against an H100's 132 SMs
    # splits each program's KV blocks up to about twice the SMs; prefill and a full batch,
    # and an unknown GPU, do not.
    def splits(num_tokens, max_reqs, kv_heads=8, kind="H100"):
        return get_block_sizes(
            "pallas_gpu", head_dim=128, page_size=16, num_tokens=num_tokens, max_reqs=max_reqs,
            device_kind=kind, num_kv_heads=kv_heads,
        ).num_splits  # fmt: skip

    assert [splits(b, b) for b in (1, 8, 16, 64)] == [16, 4, 2, 1]
    assert splits(1, 1, kv_heads=1) == 16 and splits(4, 4, kv_heads=2) == 16
    assert splits(512, 8) == 1 and splits(1, 1, kind="L4") == 1


def test_declared_cost_counts_only_requests_that_can_have_a_query():
    """The kernels declare (to XLA's cost analysis, and so to `jaxllm compile`'s predictions)
    the KV bytes at the full reach of the block tables of the requests that can have a query:
    a one-token step, whatever the block table's rows, one request's pages; capped by the pool."""
    from pallas_kernels.kv_cache import attention_cost

    heads, kv_heads, head_dim, page, pages_per_seq, pool = 8, 2, 64, 16, 32, 1024
    page_bytes = kv_heads * page * 2 * head_dim * 2  # bfloat16 keys and values
    cache = (1, pool, kv_heads, page, 2 * head_dim)

    def kv_bytes(tokens: int, rows: int) -> int:
        q_bytes = tokens * heads * head_dim * 2
        _, _, nbytes = attention_cost(
            (tokens, heads, head_dim), jnp.bfloat16, cache, jnp.bfloat16,
            (rows, pages_per_seq), False,
        )  # fmt: skip
        return nbytes - 2 * q_bytes

    assert kv_bytes(1, 256) == pages_per_seq * page_bytes
    assert kv_bytes(4, 256) == 4 * pages_per_seq * page_bytes
    assert kv_bytes(64, 4) == 4 * pages_per_seq * page_bytes  # a prefill of 4 requests
    assert kv_bytes(256, 256) == pool * page_bytes  # the pool holds no more


@pytest.mark.parametrize(
    "backend,platform,kv_dtype",
    [
        ("reference", "tpu", jnp.float32),
        ("xla", "tpu", jnp.float32),
        ("cpu", "tpu", jnp.int8),
        ("pallas_tpu", "tpu", jnp.float32),
        ("pallas_gpu", "gpu", jnp.float32),
    ],
)
def test_heads_padded_to_the_platforms_width_change_nothing(backend, platform, kv_dtype):
    """head_dim 80 in the cache a TPU or GPU lays out (rows of 128-wide heads, see
    `cache_head_dim`): write_kv pads the new keys and values with zeros, attention pads the
    queries and drops the output's padding, and every backend gives the unpadded result."""
    from pallas_kernels import cache_head_dim, write_kv
    from pallas_kernels.kv_cache import as_kv_cache, zeros_kv_cache

    if backend == "cpu" and not ragged_attention_cpu.available():
        pytest.skip("the native CPU kernel cannot be built here")
    heads, kv_heads, head_dim, page = 4, 2, 80, 16
    assert cache_head_dim(head_dim, platform) == 128 and cache_head_dim(head_dim, "cpu") == 80
    rng = np.random.default_rng(7)
    seq_lens = [20, 37]  # queries: all 20 tokens of the first, the last of the second
    tables = np.array([[0, 1, 5], [2, 3, 4]], np.int32)
    slots = np.concatenate(
        [
            tables[r, np.arange(n) // page] * page + np.arange(n) % page
            for r, n in enumerate(seq_lens)
        ]
    ).astype(np.int32)
    k, v = (jnp.asarray(rng.standard_normal((len(slots), kv_heads, head_dim)), jnp.float32)
            for _ in range(2))  # fmt: skip

    def written(platform):
        shape = get_kv_cache_shape(2, 8, page, kv_heads, head_dim, platform)
        return write_kv(zeros_kv_cache(shape, kv_dtype), 1, k, v, jnp.asarray(slots))

    padded = written(platform)
    assert padded.shape[-1] == 256
    rows = np.asarray(as_kv_cache(padded).data[1].astype(jnp.float32)).reshape(-1, 2, 128)
    assert not rows[..., head_dim:].any(), "the padding lanes must hold zeros"
    q = jnp.asarray(rng.standard_normal((24, heads, head_dim)), jnp.float32)
    args = (1, jnp.asarray(seq_lens), jnp.asarray(tables), jnp.asarray([0, 20, 21]),
            jnp.asarray([2], jnp.int32))  # fmt: skip
    ref = ragged_paged_attention(q, written("cpu"), *args, sm_scale=0.1, backend="reference")
    out = ragged_paged_attention(q, padded, *args, sm_scale=0.1, backend=backend, interpret=True)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_bad_kernel_shapes_are_named():
    args, _ = _case(np.random.default_rng(6), "decode", 2, 2, 128, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_sizes.kv_pages a power of two"):
        ragged_paged_attention(
            *args, sm_scale=0.1, backend="pallas_gpu", block_sizes=BlockSizes(16, 3)
        )
    cache = jnp.zeros(get_kv_cache_shape(2, 40, 12, 2, 128))
    with pytest.raises(ValueError, match="page_size a multiple of 8"):
        ragged_paged_attention(args[0], cache, *args[2:], sm_scale=0.1, backend="pallas_tpu")
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(*args, sm_scale=0.1, sliding_window=0, backend="pallas_tpu")


# The window as data: a prefill longer than the window, a chunked prefill whose rows cross the
# position where the window starts to cut keys off (14..29), one whose context reaches back
# past the window, and decodes, one of them longer than the window. Small blocks (one page of
# KV) so the Pallas kernels have pages to skip before the window.
WINDOW = 20
WINDOW_SEQS = [(40, 40), (16, 30), (12, 60), (1, 100), (1, 5)]
WINDOW_BLOCKS = BlockSizes(q_block=16, kv_pages=1)


def _window_case(num_layers_filled: int = 1):
    """Args for `WINDOW_SEQS` (f32, 4 q heads over 2 kv heads of 32 dims, 16-token pages) and
    the number of real rows. With `num_layers_filled=2`, layer 0 holds data too (half of
    layer 1's), for per-layer calls."""
    q, cache, seq_lens, bt, cu, _, _, _, total = make_case(
        np.random.default_rng(8),
        WINDOW_SEQS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        max_reqs=8,
        t_pad=80,
        dtype=jnp.float32,
    )
    if num_layers_filled == 2:
        cache = np.stack([cache[1] * 0.5, cache[1]])
    args = (
        jnp.asarray(q),
        jnp.asarray(cache),
        jnp.int32(1),
        jnp.asarray(seq_lens),
        jnp.asarray(bt),
        jnp.asarray(cu),
        jnp.asarray([len(WINDOW_SEQS)], jnp.int32),
    )
    return args, bt, total


def _window_kernels(backend):
    """`backend` (with `WINDOW_BLOCKS`) jitted twice: `static(*args, sliding_window=w)` with the
    window a static argument, and `traced(args, w)` with it a traced one."""
    if backend == "cpu" and not ragged_attention_cpu.available():
        pytest.skip("the native CPU kernel could not be built here")
    kernel = functools.partial(
        ragged_paged_attention, sm_scale=0.125, backend=backend, block_sizes=WINDOW_BLOCKS
    )
    static = jax.jit(kernel, static_argnames="sliding_window")
    traced = jax.jit(lambda args, window: kernel(*args, sliding_window=window))
    return static, traced


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_window_matches_static(backend):
    """A window passed as a jit argument gives what the same static int gives, and a traced 0
    (or less) what `sliding_window=None` gives. The decode of 100 tokens has its pages before
    the window filled with NaN: the reference and xla mask them, and the Pallas kernels must
    still skip them when the window is traced (their KV loop starts at the window), or the NaN
    reaches the output. (The cpu kernel would mask them even if it read them.)"""
    static, traced = _window_kernels(backend)
    args, bt, total = _window_case()
    ref = np.asarray(_window_kernels("reference")[0](*args, sliding_window=WINDOW))

    # Request 3 is a decode at position 99: its positions 0..79 are all before its window.
    poisoned_pages = bt[3, : (100 - WINDOW) // 16]
    poisoned = (args[0], args[1].at[1, poisoned_pages].set(jnp.nan), *args[2:])
    static_out = np.asarray(static(*poisoned, sliding_window=WINDOW))
    traced_out = np.asarray(traced(poisoned, jnp.int32(WINDOW)))
    assert not np.isnan(traced_out).any(), "a page before the window was read"
    np.testing.assert_allclose(static_out[:total], ref[:total], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(traced_out, static_out, atol=1e-5, rtol=1e-5)
    assert np.all(traced_out[total:] == 0)

    full = np.asarray(static(*args, sliding_window=None))
    for no_window in (0, -3):
        out = np.asarray(traced(args, jnp.int32(no_window)))
        np.testing.assert_allclose(out, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_scan_carries_each_layers_window(backend):
    """One jitted scan over two layers, a windowed one and a global one (Gemma 3's mix), with
    the windows an i32[L] scanned beside the layer index, matches per-layer calls with static
    windows."""
    static, traced = _window_kernels(backend)
    args, _, total = _window_case(num_layers_filled=2)
    q, cache, _, *metadata = args

    @jax.jit
    def layers(windows):  # i32[L]
        def layer(_, xs):
            index, window = xs
            return None, traced((q, cache, index, *metadata), window)

        return jax.lax.scan(layer, None, (jnp.arange(2, dtype=jnp.int32), windows))[1]

    out = np.asarray(layers(jnp.array([WINDOW, 0], jnp.int32)))
    for index, window in ((0, WINDOW), (1, None)):
        expect = static(q, cache, jnp.int32(index), *metadata, sliding_window=window)
        np.testing.assert_allclose(out[index], np.asarray(expect), atol=1e-5, rtol=1e-5)
    # The windowed layer differs from full attention, so the window was really applied.
    full = np.asarray(static(q, cache, jnp.int32(0), *metadata, sliding_window=None))
    assert not np.allclose(out[0, :total], full[:total], atol=1e-3)


def test_bad_sliding_window_is_named():
    args, _, _ = _window_case()
    for bad in (0, -1, True, 2.0, jnp.zeros(2, jnp.int32), jnp.float32(4.0), np.array([3])):
        with pytest.raises(ValueError, match="sliding_window"):
            ragged_paged_attention(*args, sm_scale=0.1, sliding_window=bad)


def test_an_operand_a_backend_lacks_is_refused_by_name(monkeypatch):
    """The operand table says which backends honour each optional operand: one left out
    refuses it, naming it and the backends that do, instead of ignoring it; unset, the
    operand costs that backend nothing."""
    import pallas_kernels

    args, _, _ = _window_case()
    monkeypatch.setitem(pallas_kernels.ATTENTION_OPERANDS, "soft_cap", frozenset({"reference"}))
    with pytest.raises(ValueError, match="'xla' does not support soft_cap; these do: reference"):
        ragged_paged_attention(*args, sm_scale=0.1, soft_cap=30.0, backend="xla")
    ragged_paged_attention(*args, sm_scale=0.1, soft_cap=30.0, backend="reference")
    ragged_paged_attention(*args, sm_scale=0.1, backend="xla")
    with pytest.raises(ValueError, match="unknown attention operand 'alibi_slopes'"):
        pallas_kernels.check_operands("xla", {"alibi_slopes": jnp.zeros(4)})


@pytest.mark.parametrize("backend", [pytest.param("pallas", marks=pytest.mark.slow), "pallas_gpu"])
def test_whole_model_greedy_tokens_match_the_reference(
    tiny_model_dir, tiny_llm, backend, monkeypatch
):
    """The engine with a Pallas kernel (interpreted; "pallas" is the TPU kernel on CPU) gives
    the same greedy tokens as the reference backend, over a batch that mixes prefills, chunked
    prefills (prompts longer than the 128-token step budget) and decodes."""
    import pallas_kernels
    from jaxllm import LLM, SamplingParams

    kernel = "pallas_tpu" if backend == "pallas" else backend
    traced = []  # the kernel wrapper is called when the step is traced
    wrapper = getattr(pallas_kernels, f"ragged_paged_attention_{kernel[7:]}")
    monkeypatch.setattr(
        pallas_kernels,
        wrapper.__name__,
        lambda *a, **k: traced.append(k["interpret"]) or wrapper(*a, **k),
    )
    rng = np.random.default_rng(7)
    prompts = [
        {"prompt_token_ids": rng.integers(3, 300, size=int(n)).tolist()}
        for n in (1, 5, 17, 40, 150, 200)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        tiny_model_dir,
        max_model_len=256,
        num_pages=128,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        attention_backend=backend,
        skip_warmup=True,
    )
    assert llm.attention_backend == kernel
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert traced and all(traced), "the interpreted kernel must have served the steps"
    assert got == expected
