"""Every program compiled by the real TPU and GPU compilers, on this CPU, without the hardware.

"It lowers" (the StableHLO text exists) says nothing of what Mosaic's layout passes, XLA:TPU's
memory assignment and Triton's PTX compilation do later; these tests run those compilers
(libtpu, and XLA:GPU with the CUDA plugin, through compile-only devices) and read what they
say of the compiled programs: the KV cache is updated in place and never copied, the kernels fit
their chip (scalar memory, shared memory), and `jaxllm compile`'s report adds up.

They need `jax[tpu]` and `jax[cuda12]` of the installed jax version, which would clutter the
CPU runtime (libtpu looks for TPUs, the CUDA plugin for GPUs), so `make test` runs this file in
an environment of its own, `.venv-compile` (`make compile-env`); elsewhere it skips, saying so.
The full shape matrix runs under `-m slow`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import get_block_sizes, get_kv_cache_shape, ragged_paged_attention
from pallas_kernels.kv_cache import abstract_kv_cache, as_kv_cache
from pallas_kernels.tuning import gpu_shared_memory

HAVE_TPU_COMPILER = importlib.util.find_spec("libtpu") is not None
HAVE_GPU_COMPILER = importlib.util.find_spec("jax_cuda12_plugin") is not None
WHY = "needs the {} compiler: `make test` runs this in .venv-compile (`make compile-env`)"
tpu_only = pytest.mark.skipif(not HAVE_TPU_COMPILER, reason=WHY.format("TPU (libtpu)"))
gpu_only = pytest.mark.skipif(not HAVE_GPU_COMPILER, reason=WHY.format("CUDA (jax[cuda12])"))
CONFIGS = Path(__file__).parents[1] / "benchmarks" / "configs"


def _target(name: str):
    from jaxllm.aot.targets import parse_target

    return parse_target(name)


def _compile_for(device, fn, *args, donate=()):
    """`fn` on `args` (abstract, on `device`) compiled by `device`'s real compiler, its kernels
    traced for that platform, the arguments at `donate` donated."""
    platforms = (pallas_kernels.lowering_platform(device),)
    with pallas_kernels.target_platform(device.platform, device):
        traced = jax.jit(fn, donate_argnums=donate).trace(*args)
        return traced.lower(lowering_platforms=platforms).compile()


def _compile_kernel(target: str, num_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype,
                    *, num_tokens=64, max_reqs=8, pages_per_seq=64, num_pages=2048,
                    block_sizes=None, sinks=False, window=100):  # fmt: skip
    """The attention kernel of `target` compiled for one call shape (two layers of cache), with
    the tuning table's block sizes or `block_sizes`, with `sinks` (one per q head) or not:
    (compiled executable, the cache's bytes)."""
    t = _target(target)
    device = t.devices()[0]
    sh = jax.sharding.SingleDeviceSharding(device)
    shape = get_kv_cache_shape(2, num_pages, page_size, num_kv_heads, head_dim, device.platform)
    cache = abstract_kv_cache(shape, kv_dtype, (sh, sh))
    q = jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), dtype, sharding=sh)

    def i32(*s):
        return jax.ShapeDtypeStruct(s, jnp.int32, sharding=sh)

    backend = "pallas_tpu" if device.platform == "tpu" else "pallas_gpu"
    fn = functools.partial(
        ragged_paged_attention,
        sm_scale=0.1,
        sliding_window=jnp.int32(window),
        soft_cap=None if sinks else 30.0,
        backend=backend,
        block_sizes=block_sizes,
        interpret=False,
    )
    args = (q, cache, i32(), i32(max_reqs), i32(max_reqs, pages_per_seq), i32(max_reqs + 1))
    if sinks:
        sink = jax.ShapeDtypeStruct((num_heads,), jnp.float32, sharding=sh)
        compiled = _compile_for(device, lambda *a: fn(*a[:-1], sinks=a[-1]), *args, i32(1), sink)
    else:
        compiled = _compile_for(device, fn, *args, i32(1))
    nbytes = sum(
        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in cache if a is not None
    )
    return compiled, nbytes


def _assert_no_cache_copy(compiled, cache_bytes: int) -> None:
    """No temporary of the cache's size, and the cache taken in the row-major layout the kernel
    reads: the device's layout for an unpadded head_dim 80 cache put its pages minor, and the
    relayout went to a TPU's VMEM (no temporary) while the cache was small enough to fit."""
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < cache_bytes // 4, f"{temp / 2**20:.1f} MiB of temporaries: a copy of the cache"
    data = compiled.input_formats[0][1].data
    assert data.layout.major_to_minor == tuple(range(5)), data.layout


# (q heads, kv heads per device, head_dim, page_size, dtype, cache dtype): kv-head counts that
# do not tile a TPU's sublanes (3, 5, 6, 7), head_dim 64 (K and V share a 128-lane row), 256
# (over an H100's shared memory with 16-token query blocks), 96 and 80 (rows of 192 and 160
# lanes, which a TPU laid out pages-minor and copied, and Triton refused, until the cache padded
# them: `cache_head_dim`), every cache format, both page sizes.
KERNEL_CASES = [
    (9, 3, 64, 16, jnp.bfloat16, jnp.bfloat16),
    (8, 1, 256, 32, jnp.float32, jnp.float32),
    (20, 5, 128, 16, jnp.bfloat16, jnp.int8),
    (12, 6, 128, 32, jnp.bfloat16, jnp.float8_e4m3fn),
    (16, 16, 64, 16, jnp.bfloat16, jnp.bfloat16),
    (16, 4, 96, 16, jnp.bfloat16, jnp.bfloat16),
    (8, 2, 80, 32, jnp.bfloat16, jnp.int8),
]
KERNEL_IDS = [f"n{c[0]}k{c[1]}h{c[2]}p{c[3]}-{jnp.dtype(c[5]).name}" for c in KERNEL_CASES]


@gpu_only
@pytest.mark.parametrize(
    "heads,page_size,kv_dtype",
    [(16, 16, jnp.bfloat16), (128, 64, jnp.bfloat16), (16, 64, jnp.float8_e4m3fn)],
    ids=["n16p16", "n128p64", "n16p64-fp8"],
)
def test_latent_attention_kernel_compiles_for_an_h100(heads, page_size, kv_dtype):
    """The Triton latent attention kernel at DeepSeek-V3's shapes (latent 512 + RoPE 64, 128
    heads on one GPU or 16 of them under TP 8), compiled for an H100: the cache taken as it is
    (row-major, two rows of 576 lanes to a pair row: no power-of-two padding), no copy of it."""
    device = _target("h100").devices()[0]
    sh = jax.sharding.SingleDeviceSharding(device)
    shape = get_kv_cache_shape(2, 2048, page_size, 1, 288, device.platform, latent=True)
    assert shape[-2:] == (page_size // 2, 2 * 576)
    cache = abstract_kv_cache(shape, kv_dtype, (sh, sh))
    num_tokens, max_reqs = 64, 8

    def arg(*s, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(s, dtype, sharding=sh)

    fn = functools.partial(
        pallas_kernels.mla_paged_attention, sm_scale=0.135, backend="pallas_gpu", interpret=False
    )
    compiled = _compile_for(
        device, fn,
        arg(num_tokens, heads, 512, dtype=jnp.bfloat16), arg(num_tokens, heads, 64, dtype=jnp.bfloat16),
        cache, arg(), arg(max_reqs), arg(max_reqs, 64), arg(max_reqs + 1), arg(1),
    )  # fmt: skip
    nbytes = sum(
        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in cache if a is not None
    )
    assert compiled.memory_analysis().temp_size_in_bytes < nbytes // 4
    assert compiled.input_formats[0][2].data.layout.major_to_minor == tuple(range(5))


@tpu_only
@pytest.mark.parametrize(
    "target,heads,page_size,kv_dtype",
    [
        ("v5e-1", 16, 16, jnp.bfloat16),
        ("v5e-1", 128, 64, jnp.bfloat16),
        ("v6e-1", 16, 64, jnp.int8),
        ("v6e-1", 128, 16, jnp.float8_e4m3fn),
    ],
    ids=["v5e-n16p16", "v5e-n128p64", "v6e-n16p64-int8", "v6e-n128p16-fp8"],
)
def test_latent_attention_kernel_compiles_for_a_tpu(target, heads, page_size, kv_dtype):
    """The Mosaic latent attention kernel at DeepSeek-V3's shapes (latent 512 + RoPE 64, 128
    heads on one chip or 16 under TP 8), compiled by libtpu: the cache taken as it is (two
    576-wide rows to a pair row of 9 whole tiles, so 576 lanes a token), no copy of it, a
    decode (64 requests) and a mixed prefill step."""
    device = _target(target).devices()[0]
    sh = jax.sharding.SingleDeviceSharding(device)
    # A pool of 0.6-1.2 GB, so that a copy of it would stand out among the temporaries (the
    # queries and outputs in work-item layout: 110 MB for 256 tokens x 128 heads).
    shape = get_kv_cache_shape(2, 32768 * 16 // page_size, page_size, 1, 288, "tpu", latent=True)
    assert shape[-2:] == (page_size // 2, 2 * 576)
    cache = abstract_kv_cache(shape, kv_dtype, (sh, sh))
    nbytes = sum(
        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in cache if a is not None
    )

    def arg(*s, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(s, dtype, sharding=sh)

    fn = functools.partial(
        pallas_kernels.mla_paged_attention, sm_scale=0.135, backend="pallas_tpu", interpret=False
    )
    for num_tokens, max_reqs in ((64, 64), (256, 8)):
        compiled = _compile_for(
            device, fn,
            arg(num_tokens, heads, 512, dtype=jnp.bfloat16),
            arg(num_tokens, heads, 64, dtype=jnp.bfloat16),
            cache, arg(), arg(max_reqs), arg(max_reqs, 64), arg(max_reqs + 1), arg(1),
        )  # fmt: skip
        assert "mla_paged_attention_tpu" in compiled.as_text()
        assert compiled.memory_analysis().temp_size_in_bytes < nbytes // 4
        assert compiled.input_formats[0][2].data.layout.major_to_minor == tuple(range(5))


def _compile_delta_rule(target: str, backend: str, num_tokens: int, max_reqs: int, heads=48):
    """The gated delta rule in `backend`'s form compiled for `target` at Qwen3.5-27B's linear
    layers on one device (48 value heads of key and value dim 128), the state donated (as the
    engine's step donates its cache)."""
    from pallas_kernels import gated_delta_rule

    device = _target(target).devices()[0]
    sh = jax.sharding.SingleDeviceSharding(device)
    dim = 128

    def arg(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    args = (
        *(arg(num_tokens, heads, dim) for _ in range(3)),
        *(arg(num_tokens, heads) for _ in range(2)),
        arg(max_reqs, heads, dim, dim),
        arg(max_reqs + 1, dtype=jnp.int32),
        arg(1, dtype=jnp.int32),
    )
    fn = functools.partial(gated_delta_rule, backend=backend, interpret=False)
    return _compile_for(device, fn, *args, donate=(5,))


@gpu_only
def test_delta_rule_kernel_compiles_for_an_h100():
    """Triton compiles the GPU kernel of the gated delta rule at Qwen3.5-27B's shapes for a
    prefill-heavy and a decode step; the step's recurrence is that one kernel (no `while` or
    `conditional` left to XLA, each of which would stop the host), and its temporaries hold
    no more than the padded inputs and outputs (no copy of the state beyond them)."""
    from jaxllm.worker.compiler import launches

    for num_tokens, max_reqs in ((2048, 16), (64, 64)):
        compiled = _compile_delta_rule("h100", "pallas_gpu", num_tokens, max_reqs)
        syncs, _ = launches(compiled.as_text())
        assert syncs == 0, compiled.as_text()
        state = max_reqs * 48 * 128 * 128 * 4
        tokens = (num_tokens + 64) * 48 * (3 * 128 + 2) * 4
        assert compiled.memory_analysis().temp_size_in_bytes <= 2 * (state + tokens)


@tpu_only
@pytest.mark.parametrize("target", ["v5e-1", "v6e-1"])
def test_delta_rule_kernel_compiles_for_a_tpu(target):
    """Mosaic compiles the TPU kernel of the gated delta rule at Qwen3.5-27B's shapes (all 48
    heads on one chip, and the 12 of a 4-way split) for a prefill-heavy step, a decode step
    and a ragged one; the state is updated in place (aliased: no copy of it), and the
    temporaries hold no more than the inputs padded by a chunk. (States larger than the
    chip's 128 MiB of VMEM, as an engine's are: XLA stages a smaller one through VMEM, which
    costs a temporary of its size in HBM.)"""
    for num_tokens, max_reqs, heads in ((2048, 64, 48), (64, 256, 12), (37, 256, 12)):
        compiled = _compile_delta_rule(target, "pallas_tpu", num_tokens, max_reqs, heads)
        assert "gated_delta_rule_tpu" in compiled.as_text()
        memory = compiled.memory_analysis()
        state = max_reqs * heads * 128 * 128 * 4
        assert memory.alias_size_in_bytes >= state
        tokens = (num_tokens + 64) * heads * 3 * 128 * 4
        assert memory.temp_size_in_bytes <= tokens + state // 64


@tpu_only
def test_chunked_delta_rule_compiles_for_a_tpu():
    """XLA:TPU compiles the chunked form of the gated delta rule (a TPU engine's form when its
    attention backend is "xla": the loop runs per chunk of 64 prefill tokens) at Qwen3.5-27B's
    shapes, within the chip's memory."""
    compiled = _compile_delta_rule("v6e-1", "chunked", 2048, 16)
    state = 16 * 48 * 128 * 128 * 4
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * state + 2048 * 48 * 128 * 4 * 8


# (target, q heads, kv heads, head_dim, tokens, sinks): gpt-oss's attention (64 q heads over
# 8 kv heads of 64, sinks, a 128-token window) as one device holds it (a quarter of the heads
# on a v6e-4, all on an H100), and Gemma 4's full-attention heads of 512; decode- and
# prefill-sized batches.
NEW_MODEL_SHAPES = [
    ("v6e-1", 16, 2, 64, 64, True),
    ("v6e-1", 16, 2, 64, 512, True),
    ("h100", 64, 8, 64, 64, True),
    ("h100", 64, 8, 64, 512, True),
    ("v6e-1", 8, 1, 512, 64, False),
    ("v6e-1", 8, 1, 512, 512, False),
    ("h100", 16, 2, 512, 64, False),
    ("h100", 16, 2, 512, 512, False),
]


@pytest.mark.parametrize(
    "target,num_heads,num_kv_heads,head_dim,num_tokens,sinks", NEW_MODEL_SHAPES
)
def test_kernels_compile_at_new_models_shapes(
    target, num_heads, num_kv_heads, head_dim, num_tokens, sinks
):
    """The kernels at gpt-oss's and Gemma 4's shapes, the cache read in place (the
    temporaries are the queries' and outputs' relayouts)."""
    platform_ok = HAVE_TPU_COMPILER if target.startswith("v") else HAVE_GPU_COMPILER
    if not platform_ok:
        pytest.skip(WHY.format(target))
    compiled, nbytes = _compile_kernel(
        target, num_heads, num_kv_heads, head_dim, 16, jnp.bfloat16, jnp.bfloat16,
        num_tokens=num_tokens, max_reqs=64 if sinks else 16, sinks=sinks,
        window=128 if sinks else 100,
    )  # fmt: skip
    _assert_no_cache_copy(compiled, nbytes)


@tpu_only
@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_tpu_kernel_reads_the_cache_in_place(case):
    """Mosaic compiles the kernel for v6e at these shapes and XLA hands it the cache as it is
    (the old [.., page_size, 2K, H] layout made XLA copy the whole cache for 3 kv heads)."""
    compiled, nbytes = _compile_kernel("v6e-1", *case, num_tokens=64, max_reqs=64)
    _assert_no_cache_copy(compiled, nbytes)


@gpu_only
@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_gpu_kernel_fits_an_h100(case):
    """Triton compiles the kernel for an H100 (shared memory included: the block sizes are
    cut to fit it) at decode and prefill shapes, with no copy of the cache; a decode of one or
    eight sequences with its KV blocks split (split-KV: a third grid axis, partial outputs)."""
    for num_tokens, max_reqs in ((512, 8), (64, 64), (1, 1), (8, 8)):
        compiled, nbytes = _compile_kernel("h100", *case, num_tokens=num_tokens, max_reqs=max_reqs)
        _assert_no_cache_copy(compiled, nbytes)


@tpu_only
@pytest.mark.parametrize("target", ["v5e-1", "v6e-1"])
def test_tpu_kernel_long_contexts_leave_the_block_tables_in_hbm(target):
    """64 sequences at 128k tokens (8,192 pages each: 2 MiB of block tables, twice the scalar
    memory) compile: the kernel fetches each KV block's page ids as it goes. (The pool, 4 GiB,
    holds a 16th of their reach: the tables' size, not the pool's, is what is tested.)"""
    compiled, nbytes = _compile_kernel(
        target, 32, 8, 128, 16, jnp.bfloat16, jnp.bfloat16,
        num_tokens=64, max_reqs=64, pages_per_seq=8192, num_pages=64 * 8192 // 16,
    )  # fmt: skip
    _assert_no_cache_copy(compiled, nbytes)


@pytest.mark.parametrize(
    "head_dim,page_size,group,kv,q", [(256, 16, 4, 4, 4), (256, 128, 16, 2, 2), (128, 128, 8, 4, 4)]
)
def test_gpu_block_sizes_fit_shared_memory(head_dim, page_size, group, kv, q):
    """The H100 block sizes are cut until the program's shared memory estimate fits 227 KiB,
    keeping the decode block at one query token."""
    for num_tokens, max_reqs in ((512, 8), (64, 64)):
        sizes = get_block_sizes(
            "pallas_gpu", head_dim=head_dim, page_size=page_size, num_tokens=num_tokens,
            max_reqs=max_reqs, device_kind="NVIDIA H100 80GB HBM3", group=group,
            kv_itemsize=kv, q_itemsize=q,
        )  # fmt: skip
        shape = dict(page_size=page_size, head_dim=head_dim, group=group)
        assert gpu_shared_memory(sizes, kv_itemsize=kv, q_itemsize=q, **shape) <= 232448
        if num_tokens == max_reqs:
            assert sizes.q_block == 1


@gpu_only
@pytest.mark.parametrize(
    "head_dim,q_block,kv_pages,dtype,precision",
    [
        (128, 1, 64, jnp.bfloat16, None),
        (64, 1, 64, jnp.bfloat16, None),
        (128, 16, 16, jnp.bfloat16, None),
        (256, 16, 8, jnp.bfloat16, None),
        (64, 1, 32, jnp.float32, "highest"),
        (128, 16, 16, jnp.float32, "highest"),
        (64, 1, 32, jnp.float32, None),
        (128, 1, 64, jnp.float32, "F32_F32_F32"),
    ],
    ids=[
        "decode-h128", "decode-h64", "prefill-h128", "prefill-h256", "decode-h64-f32-highest",
        "prefill-h128-f32-highest", "decode-h64-f32-tf32", "decode-h128-f32-preset",
    ],
)  # fmt: skip
def test_gpu_shared_memory_estimate_matches_the_compiler(
    head_dim, q_block, kv_pages, dtype, precision
):
    """Block sizes over an H100's shared memory, so the compiler's refusal says what it asked
    for: the estimate the table cuts block sizes by is that, within 2%, and never under it
    (decode blocks and prefill blocks, whose dots Triton lays out differently; float32 dots
    as TF32 and, under JAX's "highest" precision, as IEEE float32, whose decode blocks an H100
    refused at run time when the estimate did not know them)."""
    from pallas_kernels.tuning import BlockSizes, exact_float32_dots

    sizes = BlockSizes(q_block, kv_pages, num_warps=4, num_stages=2)
    with jax.default_matmul_precision(precision), pytest.raises(Exception) as refused:
        _compile_kernel("h100", 32, 8, head_dim, 16, dtype, dtype, max_reqs=64, block_sizes=sizes)
    asked = int(
        re.search(r"Shared memory size limit exceeded: requested (\d+)", str(refused.value))[1]
    )
    item = jnp.dtype(dtype).itemsize
    with jax.default_matmul_precision(precision):
        exact = exact_float32_dots()
    assert exact == (precision is not None)
    estimate = gpu_shared_memory(
        sizes, page_size=16, head_dim=head_dim, group=4, kv_itemsize=item, q_itemsize=item,
        exact_float32=exact,
    )  # fmt: skip
    assert asked <= estimate <= 1.02 * asked


@gpu_only
@pytest.mark.parametrize("num_tokens,max_reqs", [(64, 64), (4, 4), (512, 4)])
def test_gpu_kernel_fits_an_h100_with_exact_float32_dots(num_tokens, max_reqs):
    """The demo model's shape (9 q / 3 kv heads, head_dim 64) in float32 under JAX's "highest"
    precision, as a float32 parity run sets it: the table's decode block asked an H100 for
    260 KiB of shared memory and failed at its first step on the device; the block sizes are
    now cut to what IEEE float32 dots take."""
    with jax.default_matmul_precision("highest"):
        compiled, nbytes = _compile_kernel(
            "h100", 9, 3, 64, 16, jnp.float32, jnp.float32, num_tokens=num_tokens,
            max_reqs=max_reqs,
        )  # fmt: skip
    _assert_no_cache_copy(compiled, nbytes)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", range(1, 17))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("target", ["v5e-1", "h100"])
def test_kernel_matrix(request, target, page_size, cache_dtype, head_dim, kv_heads):
    """The whole matrix: kv heads per device 1 to 16, head_dim 64/128/256, every cache format,
    page sizes 16 and 32, for TPU v5e and an H100 (768 compilations: `-m slow` only, as the
    suite's other slow tests, since nothing deselects them by default)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full matrix: pytest -m slow tests/test_accelerator_compile.py")
    platform_ok = HAVE_TPU_COMPILER if target.startswith("v") else HAVE_GPU_COMPILER
    if not platform_ok:
        pytest.skip(WHY.format(target))
    kv_dtype = pallas_kernels.QUANTIZED_KV_DTYPES.get(cache_dtype, cache_dtype)
    dtype = jnp.float32 if cache_dtype == "float32" else jnp.bfloat16
    compiled, nbytes = _compile_kernel(
        target, 2 * kv_heads, kv_heads, head_dim, page_size, dtype, kv_dtype, num_pages=1024
    )
    _assert_no_cache_copy(compiled, nbytes)


# ---- whole engines -----------------------------------------------------------------------


def _tiny_config(
    path: Path,
    *,
    moe: bool = False,
    gemma: bool = False,
    llava: bool = False,
    qwen_vl: str | None = None,
    hybrid: bool = False,
    gpt_oss: bool = False,
    llama4: bool = False,
    gemma4: bool = False,
    deepseek: bool = False,
) -> Path:
    """A config.json alone (no weights): 2 layers, 4 q heads over 2 kv heads of 64 dims; or
    Gemma 3's layout in 4 layers (3 sliding, 1 full: the hybrid KV cache's 4 groups); with
    `llava`, behind a vision tower: LLaVA's (CLIP) for the Llama layout, Gemma 3's (SigLIP,
    pooled to 16 tokens that attend to each other) for Gemma's; `qwen_vl` "2.5": Qwen2.5-VL's
    windowed tower (images of up to 16 tokens) before a Qwen2 decoder with M-RoPE, "2":
    Qwen2-VL's; `hybrid`: Qwen3-Next's layout in 4 layers (3 Gated DeltaNet, 1 gated
    attention; experts with a shared one); `gpt_oss`: gpt-oss's layout in 4 layers
    (sinks, sliding and full layers alternating, YaRN, biased experts in MXFP4); `llama4`: Llama 4's
    in 4 layers (chunked layers and ones without RoPE, MoE layers between dense ones);
    `gemma4`: Gemma 4's in 6 layers, the 31B's head ratios (16 q heads; sliding layers 16
    kv heads of 64, two to a cache row, in two slots; full layers 4 of 128 whose values are
    their keys), the last two sharing KV, per-layer inputs, the MoE block beside the MLP;
    `deepseek`: DeepSeek-V3's in 3 layers (latent attention, 128 + 16 wide, with q's low rank
    and YaRN; a dense layer, then 8 experts in 4 groups with a shared one), shipped in FP8
    blocks, experts kept so."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    if moe:
        config |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    if hybrid:
        config |= {
            "architectures": ["Qwen3NextForCausalLM"],
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "partial_rotary_factor": 0.25,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        }
    if gpt_oss:
        config |= {
            "architectures": ["GptOssForCausalLM"],
            "num_hidden_layers": 4,
            "sliding_window": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128,
            },
            # As shipped: the experts in MXFP4, kept 4-bit on the device.
            "quantization_config": {"quant_method": "mxfp4"},
        }  # fmt: skip
    if llama4:
        config |= {
            "architectures": ["Llama4ForCausalLM"],
            "num_hidden_layers": 4,
            "attention_chunk_size": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "intermediate_size": 64,
            "intermediate_size_mlp": 256,
            "tie_word_embeddings": False,
        }
    if gemma4:
        sliding, full = "sliding_attention", "full_attention"
        config |= {
            "architectures": ["Gemma4ForCausalLM"],
            "num_hidden_layers": 6,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "global_head_dim": 128,
            "num_global_key_value_heads": 4,
            "attention_k_eq_v": True,
            "sliding_window": 64,
            "layer_types": [sliding, sliding, full, sliding, sliding, full],
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 16,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 64,
            "final_logit_softcapping": 30.0,
        }
    if deepseek:
        config |= {
            "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": 3,
            "q_lora_rank": 64,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "num_nextn_predict_layers": 1,  # an MTP layer (read with method mtp)
            "rope_scaling": {
                "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            },
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        }  # fmt: skip
    if gemma:
        sliding, full = "sliding_attention", "full_attention"
        config |= {
            "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": 4,
            "sliding_window": 64,
            "layer_types": [sliding, sliding, full, sliding],
            "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    if llava and gemma:
        config = {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "image_token_index": 511,
            "mm_tokens_per_image": 16,
            "text_config": {**config, "model_type": "gemma3_text"},
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": 64,
                "patch_size": 8,
            },
        }
    elif llava:  # the decoder above behind a CLIP tower (2 layers, 49 patches) and projector
        config = {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "image_token_id": 511,
            "text_config": {**config, "model_type": "llama"},
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "image_size": 56,
                "patch_size": 8,
            },
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
        }
    path.mkdir(parents=True, exist_ok=True)
    if qwen_vl:
        tower = {"depth": 2, "num_heads": 4}
        if qwen_vl == "2":
            tower |= {"embed_dim": 128, "hidden_size": 128, "mlp_ratio": 2}
        else:
            tower |= {"hidden_size": 128, "intermediate_size": 256, "out_hidden_size": 128}
            tower |= {"fullatt_block_indexes": [1]}
        config |= {
            "architectures": [
                "Qwen2VLForConditionalGeneration"
                if qwen_vl == "2"
                else "Qwen2_5_VLForConditionalGeneration"
            ],
            "model_type": "qwen2_vl" if qwen_vl == "2" else "qwen2_5_vl",
            "image_token_id": 511,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
            "vision_config": tower,
        }
        processor = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16}
        (path / "preprocessor_config.json").write_text(json.dumps(processor))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _eagle3_config(path: Path, target: Path) -> Path:
    """An EAGLE-3 head's config.json alone for the target at `target` (its width, a draft
    vocabulary of 256, layers 0, 1 and the output)."""
    t = json.loads((target / "config.json").read_text())
    path.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t["hidden_size"],
        "intermediate_size": 256,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": t["vocab_size"], "draft_vocab_size": 256,
        "target_hidden_size": t["hidden_size"], "rms_norm_eps": 1e-5,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


# (target, model, engine settings): TP 1 and 4 on v5e and v6e, TP 1 and 2 on an H100;
# quantized weights, 8-bit caches, mixture of experts (ragged_dot), speculative decoding, the
# host KV tier's copy programs, a decoder's pooler and LoRA slots spread over them. The sampler with its grammar bitmask and draft verification is in every
# engine's head program. Each takes 2-5 minutes on 2 cores (the hybrid Gemma ones seconds):
# the default suite compiles a TPU slice under tensor parallelism, a GPU host with MoE and the
# hybrid KV cache on both; `-m slow` all eight.
SLOW = pytest.mark.slow
ENGINES = [
    pytest.param("v5e-1", "llama", dict(kv_cache_dtype="int8", speculative_config={
        "method": "ngram", "num_speculative_tokens": 2}), marks=SLOW, id="v5e-1"),
    pytest.param("v5e-4", "llama", dict(quantization="int8", kv_offloading_size=1,
                 runner="pooling"), id="v5e-4"),
    pytest.param("v6e-1", "moe", dict(quantization="int4"), marks=SLOW, id="v6e-1"),
    pytest.param("v6e-4", "moe", dict(kv_cache_dtype="fp8"), marks=SLOW, id="v6e-4"),
    pytest.param("h100", "llama", dict(quantization="int8", kv_cache_dtype="fp8"), marks=SLOW,
                 id="h100"),
    pytest.param("h100x2", "moe", dict(kv_offloading_size=1, enable_lora=True, max_loras=2,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                 id="h100x2"),
    # An EAGLE-3 head (a config.json alone): the target's aux states out of the forward
    # pass, the head's step over the batch and its drafting, on the target's pages.
    pytest.param("h100x2", "llama", dict(speculative_config="eagle3"), id="h100x2-eagle3"),
    pytest.param("v5e-1", "llama", dict(speculative_config="eagle3"), marks=SLOW,
                 id="v5e-1-eagle3"),
    # The hybrid KV cache: a table and slot mapping per layer group, the cache's layer axis
    # a group's slots.
    pytest.param("v5e-1", "gemma", dict(kv_offloading_size=1), id="v5e-1-hybrid"),
    pytest.param("h100", "gemma", dict(kv_cache_dtype="int8"), id="h100-hybrid"),
    # An image-text model: the vision encoder's programs (its tower split over the chips'
    # heads and MLP width) and the forward pass reading the encoder cache.
    pytest.param("v5e-4", "llava", {}, id="v5e-4-llava"),
    pytest.param("h100", "llava", dict(quantization="int8"), id="h100-llava"),
    # Gemma 3's images: whole in a chunk, their tokens attending to each other (the kernels'
    # attend_to operand), on the hybrid KV cache.
    pytest.param("v6e-1", "gemma3-vl", dict(max_num_batched_tokens=16), id="v6e-1-gemma3-vl"),
    pytest.param("h100", "gemma3-vl", dict(max_num_batched_tokens=16), id="h100-gemma3-vl"),
    # Qwen2.5-VL: images of any size as patches in buckets, the windowed tower, M-RoPE's
    # [3, T] positions in the forward pass.
    pytest.param("v5e-4", "qwen-vl", dict(enable_mm_embeds=True), id="v5e-4-qwen-vl"),
    pytest.param("h100", "qwen-vl", dict(quantization="int8"), id="h100-qwen-vl"),
    pytest.param("v6e-1", "qwen2-vl", {}, id="v6e-1-qwen2-vl"),
    # A hybrid (Qwen3-Next): the recurrent state in the donated cache beside the KV pages,
    # its heads split over 2 devices; the recurrence is each platform's Pallas kernel (on a
    # GPU its chunk loop leaves no `while` to XLA: none of the GPU's programs syncs with the
    # host).
    pytest.param("v5e-4", "hybrid", dict(tensor_parallel_size=2), id="v5e-4-hybrid"),
    pytest.param("h100", "hybrid", {}, id="h100-qwen3-next"),
    # gpt-oss: attention sinks (split with the heads), sliding and full layers in two groups,
    # experts with biases split over the chips.
    pytest.param("v5e-4", "gpt-oss", dict(tensor_parallel_size=4), id="v5e-4-gpt-oss"),
    pytest.param("h100", "gpt-oss", dict(kv_cache_dtype="fp8"), marks=SLOW, id="h100-gpt-oss"),
    # Llama 4: chunked attention, layers without RoPE, sigmoid-routed experts.
    pytest.param("h100", "llama4", {}, id="h100-llama4"),
    pytest.param("v6e-4", "llama4", dict(tensor_parallel_size=4), marks=SLOW, id="v6e-4-llama4"),
    # Gemma 4: layers of two head widths packed into one cache row shape, a layer in two
    # slots, layers reading another's KV, per-layer inputs, experts beside the MLP.
    pytest.param("v5e-4", "gemma4", dict(tensor_parallel_size=4), id="v5e-4-gemma4"),
    pytest.param("h100", "gemma4", {}, marks=SLOW, id="h100-gemma4"),
    # DeepSeek-V3: latent attention over one row a token (the GPU's Triton kernel: no host
    # sync; the plain JAX form on a TPU), its heads split and the latent cache whole on each
    # chip; FP8 experts kept, split by expert.
    pytest.param("h100", "deepseek", {}, id="h100-deepseek"),
    # Its MTP layer drafting (a latent-attention MoE layer of its own on the target's pages).
    pytest.param("h100", "deepseek", dict(speculative_config={
        "method": "mtp", "num_speculative_tokens": 2}), id="h100-deepseek-mtp"),
    pytest.param("v5e-4", "deepseek", dict(tensor_parallel_size=2), marks=SLOW,
                 id="v5e-4-deepseek"),
]  # fmt: skip


@pytest.mark.parametrize("target,model,settings", ENGINES)
def test_every_program_compiles_for_the_target(tmp_path, target, model, settings):
    """Every program a tiny engine compiles at startup compiles for the target with its real
    compiler, each step program aliases the donated KV cache (updated in place) and holds no
    temporary the size of its data, and the engine fits the chip."""
    needed = HAVE_TPU_COMPILER if target.startswith("v") else HAVE_GPU_COMPILER
    if not needed:
        pytest.skip(WHY.format(target))
    from jaxllm.aot.engine import compile_engine
    from jaxllm.config import EngineConfig

    path = _tiny_config(
        tmp_path / model,
        moe=model == "moe",
        gemma=model in ("gemma", "gemma3-vl"),
        llava=model in ("llava", "gemma3-vl"),
        qwen_vl={"qwen-vl": "2.5", "qwen2-vl": "2"}.get(model),
        hybrid=model == "hybrid",
        gpt_oss=model == "gpt-oss",
        llama4=model == "llama4",
        gemma4=model == "gemma4",
        deepseek=model == "deepseek",
    )
    settings = dict(max_num_seqs=2, max_num_batched_tokens=8, num_pages=65536) | settings
    if settings.get("speculative_config") == "eagle3":
        settings["speculative_config"] = {
            "method": "eagle3", "model": str(_eagle3_config(tmp_path / "head", path)),
            "num_speculative_tokens": 3,
        }  # fmt: skip
    config = EngineConfig.create(path, **settings)
    engine = compile_engine(config, _target(target), progress=False, keep_executables=True)
    runner = engine.runner
    assert len(runner.programs) == runner.num_programs
    names = {p.name for p in runner.programs}
    if settings.get("kv_offloading_size"):
        assert {"kv_offload_store", "kv_offload_load"} <= names
    assert ("hidden_pooler" in names) == (settings.get("runner") == "pooling")
    if model in ("gemma", "gemma3-vl"):
        assert runner.kv_groups.num_groups == 4 and runner.kv_cache.shape[0] == 1
    head = (settings.get("speculative_config") or {}).get("method")
    if head in ("eagle3", "mtp"):
        for name in (f"{head}_step", f"{head}_fill"):  # (the fill: speculation paused)
            assert {p.shape for p in runner.programs if p.name == name} == set(runner.shapes)
    if model == "gemma4":  # 1 full layer with KV of its own; 3 sliding ones x 2 slots
        assert runner.kv_groups.windows == (None,) + (64,) * 6
        shape = runner.kv_cache.shape
        assert (shape[0], shape[2], shape[4]) == (1, 4, 256), shape
    if model in ("llava", "gemma3-vl"):
        assert {p.shape for p in runner.programs if p.name == "encode_images"} == {(1,)}
    if model in ("qwen-vl", "qwen2-vl"):  # 16 tokens' patches a launch; M-RoPE positions
        assert {p.shape for p in runner.programs if p.name == "encode_images"} == {(64,)}
        assert runner.inputs.input_batch.mrope
    stores = {p.shape for p in runner.programs if p.name == "store_image_embeds"}
    assert stores == ({(16,)} if settings.get("enable_mm_embeds") else set())
    assert runner.inputs.mm_attend == (model == "gemma3-vl")
    steps = [p for p in runner.programs if p.updates_cache]
    assert steps and not runner.cache_copies()
    # A hybrid's recurrent state is updated in place too (XLA:TPU copied the convolution's
    # state in every forward program while it had its taps as an axis of their own).
    assert not [(p.name, p.shape, p.state_copy_ops) for p in steps if p.state_copy_ops]
    for p in steps:  # (a proposer's step updates its own, smaller cache)
        own = p.cache_bytes if p.name.startswith(("eagle3_", "mtp_", "draft_")) else 0
        assert p.alias_bytes >= (own or runner.kv_cache_device_bytes), p
    data = as_kv_cache(runner.device.kv_cache).data
    cache_shape = data.sharding.shard_shape(data.shape)
    for p in (p for p in steps if p.name == "forward"):  # the host tier's loads write blocks
        text = runner.compiler.executables[p.name, p.shape].as_text()
        assert not _fused_into_cache_writes(text, cache_shape, max(p.shape)), (p.name, p.shape)
        if model == "deepseek":  # the platform's latent attention kernel, not the plain JAX
            kernel = "mla_paged_attention_" + ("tpu" if target.startswith("v") else "gpu")
            assert kernel in text, (p.name, p.shape)
    assert engine.weight_device_bytes + engine.kv_cache_device_bytes < (
        engine.target.limit_bytes(engine.config.cache.memory_utilization)
    )
    # A GPU step stops the host at every `conditional` and `while` (XLA:GPU asks the host for
    # the predicate): no program of a GPU engine holds one. Its head-and-sampler programs come
    # in the GPU's variants, one per logit bucket each.
    if engine.target.chip.platform == "cuda":
        syncing = [(p.name, p.shape, p.host_syncs) for p in runner.programs if p.host_syncs]
        assert not syncing, syncing
        assert all(p.kernels > 0 for p in runner.programs)
        heads = [p for p in runner.programs if p.name.startswith("head_and_sample[")]
        assert len(heads) == len(runner.logit_buckets) * 4


def _fused_into_cache_writes(hlo: str, cache_shape: tuple, num_tokens: int) -> list[str]:
    """Inputs of the compiled program's KV cache writes (fusions whose root scatters into an
    array of the cache's shape) larger than the rows a step of `num_tokens` writes: work XLA
    fused into the write. XLA:GPU fused a one-token step's K/V projection there, computed
    element by element (11 of an 8B decode step's 21 ms on an H200) until `write_kv`'s
    optimization barrier."""
    *_, kv_heads, _, row = cache_shape
    bound = 2 * max(num_tokens, 2) * kv_heads * row  # the rows, with room for their index
    cache = ",".join(map(str, cache_shape))
    found = []
    for header, body in re.findall(r"^(%\S+ \([^\n]*\) -> \S+) \{\n(.*?)^\}", hlo, re.M | re.S):
        root = re.search(r"ROOT %\S+ = (\w+)\[([\d,]*)\]\S* (\w+)\(", body)
        if root is None or root.group(3) != "scatter" or root.group(2) != cache:
            continue
        for name, dims in re.findall(r"(\w[\w.]*): \w+\[([\d,]*)\]", header):
            size = int(np.prod([int(d) for d in dims.split(",") if d]))
            if dims != cache and size > bound:
                found.append(f"{header.split()[0]} {name}[{dims}]")
    return found


def _run_cli(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    from jaxllm.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue()


@tpu_only
def test_compile_report_adds_up(tmp_path):
    """`jaxllm compile` from a config.json alone: the weights' and the KV cache's bytes per
    device match a hand computation, the pool fills what memory_utilization leaves, no program
    copies the cache, the decode prediction is labelled as one, and the executables are saved."""
    path = _tiny_config(tmp_path / "tiny")
    report = tmp_path / "report.json"
    rc, text = _run_cli(
        "compile", str(path), "--target", "v5e-4", "--tensor-parallel-size", "2",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--programs", "decode",
        "--json", str(report), "--save-executables", str(tmp_path / "xla"), "--quiet",
    )  # fmt: skip
    assert rc == 0, text
    assert "PREDICTED" in text
    manifest = json.loads((tmp_path / "xla" / "manifest.json").read_text())
    assert manifest["programs"] and manifest["target"] == "v5e-4"
    assert all((tmp_path / "xla" / p["file"]).stat().st_size > 0 for p in manifest["programs"])
    data = json.loads(report.read_text())
    m = data["memory_per_device"]
    # By hand: 2 layers of q/k/v/o (128 x 256, 128 x 128 twice, 256 x 128) and gate/up/down
    # (128 x 256 x 3), norms (5 x 128), the tied embedding (512 x 128), bfloat16, split over 2.
    layer = 128 * 256 + 2 * 128 * 128 + 256 * 128 + 3 * 128 * 256 + 2 * 128
    weights = (2 * layer + 512 * 128 + 128) * 2
    assert m["weight_bytes"] == pytest.approx(weights / 2, rel=0.05)
    # A page: 2 layers x 1 kv head per device x 16 tokens x 2 x 64 dims, bfloat16.
    assert m["kv_page_bytes"] == 2 * 1 * 16 * 128 * 2
    assert m["kv_cache_bytes"] == m["num_pages"] * m["kv_page_bytes"]
    budget = 15.75 * 2**30 * 0.9 - m["weight_device_bytes"]  # XLA:TPU allows 15.75 GiB of 16
    assert budget - m["kv_page_bytes"] < m["kv_cache_bytes"] <= budget
    assert data["kv_cache_copies"] == [] and data["kv_cache_in_place"] > 0
    rows = data["decode_prediction"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4] and all(r["tokens_per_s"] > 0 for r in rows)


@tpu_only
@pytest.mark.parametrize("kv_dtype,target", [("int8", "v5e-1"), ("fp8", "v6e-4")])
def test_an_8bit_pool_filling_the_chip_is_updated_in_place(tmp_path, kv_dtype, target):
    """An 8-bit cache's scales (2K * page_size lanes per page, 32 to 64 here) are padded to
    whole tiles and their pages to a multiple of 8: a pool sized to fill the chip (an odd page
    count) compiles with no copy of the data or the scales. Before, XLA:TPU copied the scales
    at every layer, and a full v5e pool failed with RESOURCE_EXHAUSTED."""
    path = _tiny_config(tmp_path / "tiny")
    report = tmp_path / "report.json"
    rc, text = _run_cli(
        "compile", str(path), "--target", target, "--kv-cache-dtype", kv_dtype,
        "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--programs", "decode",
        "--json", str(report), "--quiet",
    )  # fmt: skip
    assert rc == 0, text
    data = json.loads(report.read_text())
    assert data["memory_per_device"]["num_pages"] % 8, "a page count off the 8 is the case"
    assert data["kv_cache_copies"] == [] and data["kv_scales_copies"] == []


@gpu_only
def test_compile_report_for_a_gpu(tmp_path):
    """XLA:GPU gives no cost analysis for compile-only devices: `jaxllm compile --target h100`
    still reports, its decode prediction counted from the weights and the cache and saying so."""
    path = _tiny_config(tmp_path / "tiny")
    report = tmp_path / "report.json"
    rc, text = _run_cli(
        "compile", str(path), "--target", "h100", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "16", "--programs", "decode", "--json", str(report), "--quiet",
    )  # fmt: skip
    assert rc == 0, text
    assert "PREDICTED from the weights' and KV cache's bytes" in text
    data = json.loads(report.read_text())
    rows = data["decode_prediction"]["rows"]
    assert [r["source"] for r in rows] == ["counted", "counted"]
    m = data["memory_per_device"]
    for r in rows:
        kv_read = r["batch"] * r["context"] * m["kv_page_bytes"] / data["page_size"]
        assert r["bytes_per_step"] == pytest.approx(m["weight_device_bytes"] + kv_read)
    assert data["kv_cache_copies"] == []
    # What each program launches, and that no GPU program stops the host.
    assert "host syncs (conditional, while): none in any program" in text
    programs = data["programs"]
    assert all(p["host_syncs"] == 0 and p["kernels"] > 0 for p in programs), programs
    names = {p["name"] for p in programs}
    assert {"head_and_sample[greedy]", "head_and_sample[modify+random+logprobs]"} <= names


@tpu_only
def test_compile_refuses_what_does_not_fit():
    """Llama-3.1-70B in bfloat16 on one v5e chip: a clear refusal that names what would fit,
    before anything is compiled."""
    from jaxllm.aot.engine import DoesNotFit, compile_engine
    from jaxllm.config import EngineConfig

    config = EngineConfig.create(CONFIGS / "llama-3.1-70b")
    with pytest.raises(DoesNotFit) as e:
        compile_engine(config, _target("v5e-1"), progress=False)
    message = str(e.value)
    assert "does not fit v5e-1" in message and "GiB per device" in message
    assert "--target v5e-16" in message  # the fewest chips that hold it: two hosts


@pytest.mark.parametrize(
    "target,advice",
    [
        ("v5e-1", "--target v5e-16 (tensor parallelism 16: ~8.2 GiB"),  # two hosts
        ("v6e-1", "--target v6e-8 (tensor parallelism 8: ~16.4 GiB"),
        (
            "h100",
            "--target h100x4 (tensor parallelism 4: ~32.8 GiB of weights per device); or --quantization int4 (~41.1 GiB",
        ),
    ],
)
def test_fit_advice_names_what_would_hold_the_weights(target, advice):
    """Llama-3.1-70B's 131.4 GiB of bfloat16 weights: the fewest devices that hold them, or
    smaller weights, and both together only where neither alone would do."""
    from jaxllm.aot.engine import fit_advice
    from jaxllm.config import EngineConfig

    config = EngineConfig.create(CONFIGS / "llama-3.1-70b")
    text = fit_advice(config, _target(target), jnp.bfloat16, int(131.4 * 2**30), 2**20)
    assert advice in text, text


def test_fit_advice_leaves_experts_float():
    """A mixture of experts (Llama 4 Scout: 200.7 GiB of weights, 188 GiB of them experts):
    int8 and int4 quantize the rest only, so on one H200 neither is offered; four are."""
    from jaxllm.aot.engine import fit_advice
    from jaxllm.config import EngineConfig

    config = EngineConfig.create(CONFIGS / "llama-4-scout")
    weights, experts = int(200.7 * 2**30), int(188 * 2**30)
    text = fit_advice(config, _target("h200"), jnp.bfloat16, weights, 2**20, experts)
    assert "--quantization" not in text and "--target h200x4" in text, text


def test_compile_names_a_missing_compiler(monkeypatch):
    """Without the target's compiler installed the command says which package to install."""
    from jaxllm.aot import targets

    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    targets._topology_devices.cache_clear()
    with pytest.raises(ValueError, match=r"pip install \"jax\[tpu\]=="):
        targets.parse_target("v6e-1").devices()
    targets._topology_devices.cache_clear()


@tpu_only
@pytest.mark.parametrize(
    "name,chips,hosts", [("v6e-16", 16, 4), ("v5p-16", 8, 2), ("v5e-32", 32, 8)]
)
def test_multi_host_slices_are_targets(name, chips, hosts):
    """A slice past one host (as `jaxllm serve` runs one, a process per host) is a target:
    libtpu describes its devices offline, each with its host's process."""
    from jaxllm.aot.targets import parse_target

    devices = parse_target(name).devices()
    assert len(devices) == chips and len({d.process_index for d in devices}) == hosts


@pytest.mark.parametrize("bad", ["v5e-3", "v5p-6", "a100", "h100x3", "v6e-64", "v5p-64"])
def test_bad_targets_are_named(bad):
    from jaxllm.aot.targets import parse_target

    with pytest.raises(ValueError, match="--target"):
        parse_target(bad)


@tpu_only
def test_pool_is_sized_from_the_compiled_layout():
    """A TPU pads the cache's lanes to 128: with head_dim 80 (2H = 160 lanes) a page takes the
    bytes of 256 lanes, and the pool is sized by those, not the logical ones."""
    from jaxllm.config import ModelConfig
    from jaxllm.sharding import kv_cache_placement
    from jaxllm.worker.kv_sizing import bytes_per_page, device_page_bytes

    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=640, intermediate_size=64,
        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=80, max_position_embeddings=4096,
    )  # fmt: skip
    device = _target("v6e-1").devices()[0]
    placement = kv_cache_placement(None, jnp.bfloat16, device)
    logical = bytes_per_page(config, 16, jnp.bfloat16)
    physical = device_page_bytes(config, 16, jnp.bfloat16, placement)
    assert physical == logical * 256 // 160


def test_gpu_memory_utilization_is_a_share_of_the_whole_device(monkeypatch):
    """vLLM's gpu_memory_utilization: the engine's share of the whole GPU. The engine sets
    JAX's pool to it before JAX starts, unless the operator set XLA_PYTHON_CLIENT_MEM_FRACTION
    (then the engine keeps within the smaller of the two); a TPU's programs' limit is shared as
    before. Needs no compiler."""
    from jax._src import xla_bridge

    from jaxllm.aot.targets import parse_target
    from jaxllm.worker.kv_sizing import GPU_RESERVE, engine_bytes, preallocate_gpu_memory

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    preallocate_gpu_memory(0.9)  # too late: JAX has started, its pool is what there is
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    preallocate_gpu_memory(0.9)
    assert float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == 0.9
    h100 = parse_target("h100")
    whole = h100.chip.memory_bytes
    assert h100.limit_bytes(0.9) == int(whole * 0.9)
    assert engine_bytes("cuda", int(whole * 0.9), 0.9) == pytest.approx(
        0.9 * whole * (1 - GPU_RESERVE), rel=1e-6
    )
    # The operator's pool: 0.95 of the device, of which the engine takes its 0.9; or 0.5.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    preallocate_gpu_memory(0.8)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    assert engine_bytes("gpu", int(whole * 0.95), 0.9) == pytest.approx(
        0.9 * whole * (1 - GPU_RESERVE), rel=1e-6
    )
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert engine_bytes("gpu", int(whole * 0.5), 0.9) == pytest.approx(
        0.5 * whole * (1 - GPU_RESERVE), rel=1e-6
    )
    # A TPU: memory_utilization of what its programs may use.
    v5e = parse_target("v5e-1")
    assert engine_bytes("tpu", v5e.limit_bytes(0.9), 0.9) == int(15.75 * 2**30 * 0.9)


@gpu_only
def test_a_30b_moe_fits_an_h100_at_vllms_memory_utilization(tmp_path, monkeypatch):
    """Qwen3-30B-A3B in bfloat16 (56.9 GiB of weights) on one H100 at --gpu-memory-utilization
    0.9: JAX's default pool of 75% refused it; as a share of the whole device (vLLM's meaning)
    it fits, with a KV pool of what vLLM's 0.9 leaves (within a few GiB of temporaries)."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    report = tmp_path / "report.json"
    rc, text = _run_cli(
        "compile", str(CONFIGS / "qwen3-30b-a3b"), "--target", "h100", "--max-num-seqs", "1",
        "--max-num-batched-tokens", "16", "--programs", "decode", "--json", str(report),
        "--quiet",
    )  # fmt: skip
    assert rc == 0, text
    m = json.loads(report.read_text())["memory_per_device"]
    whole = _target("h100").chip.memory_bytes
    assert m["usable_bytes"] == int(0.9 * whole)
    assert m["fits"] and m["weight_device_bytes"] > 56 * 2**30
    vllm_kv = 0.9 * whole - m["weight_device_bytes"] - 2 * 2**30  # ~1-2 GiB of activations
    assert m["kv_cache_bytes"] > 0.9 * vllm_kv, (m["kv_cache_bytes"] / 2**30, vllm_kv / 2**30)
