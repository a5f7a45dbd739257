"""Quantized weights (jaxllm/quantization.py): the native CPU matmul against XLA's
dequantization, GGUF block types kept as integers bit for bit, the demo model's bytes and
logits, and the engine with int8 / int4 / fp8 weights (no compilation after warmup, tensor
parallel splits giving the same tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.quantization import (
    QArray,
    SplitRows,
    dequantize,
    dequantize_np,
    head_int8_rows,
    pack_int4,
    qmatmul,
    qmatmuls,
    quantize,
    quantize_head,
    take_rows,
    unpack_int4,
)
from jaxllm.testing import random_qarray
from pallas_kernels import quant_matmul_cpu

from helpers import prefill_logits, tensor_parallel_report


@pytest.mark.skipif(not quant_matmul_cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize(
    "num_in,group,offset,scale_dtype",
    [
        (256, 256, False, np.float32),  # per channel
        (256, 64, True, np.float16),  # a group size known only at run time
        (256, 32, True, np.float16),  # GGUF's and our int4's, unrolled
        (256, 16, False, np.float32),  # Q6_K's (not int4: its blocks are 32)
        (48, 48, False, np.float32),  # I not a multiple of the vector width
    ],
)
def test_native_matmul_matches_xla_dequantization(fmt, num_in, group, offset, scale_dtype):
    """The float path (fp8's, and int8 and int4's where the CPU has no 8-bit dot products):
    every row count the micro-kernel special-cases (1-3 leftovers, blocks of 4), output rows
    that do not fill a block (O = 70), each dequantization loop, float16 and float32
    factors."""
    if fmt == "int4" and (group % 32 or num_in % 32):
        pytest.skip("int4 groups are whole 32-blocks")
    rng = np.random.default_rng(0)
    w = random_qarray(rng, fmt, 70, num_in, num_in // group, offset, scale_dtype)
    dense = dequantize_np(w)
    for t in (1, 2, 3, 4, 7):
        x = rng.standard_normal((t, num_in)).astype(np.float32)
        got = jax.jit(
            lambda x, w: quant_matmul_cpu.quant_matmul_cpu(
                x, w.q, w.scale, w.offset, w.fmt, "float"
            )
        )(x, jax.tree.map(jnp.asarray, w))
        xla = x @ np.asarray(dequantize(jax.tree.map(jnp.asarray, w))).T
        np.testing.assert_allclose(got, x @ dense.T, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(xla, x @ dense.T, rtol=1e-4, atol=1e-3)


def _rounded_per_16(x: np.ndarray) -> np.ndarray:
    """x as the integer path sees it: int8 codes per 16 inputs, scale max|x| / 127."""
    v = x.reshape(x.shape[0], -1, 16)
    amax = np.abs(v).max(-1, keepdims=True)
    inv = np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0)
    return (np.rint(v * inv) * (amax / 127)).reshape(x.shape).astype(np.float32)


def _native_product(x: np.ndarray, w: QArray, variant: str = "native") -> tuple[np.ndarray, bool]:
    """x @ w.T as that build of the native kernel computes it (up to summation order), and
    whether it takes the integer path (int8 / int4 codes in groups of whole 16s)."""
    integer = (
        w.fmt != "fp8" and quant_matmul_cpu.path(variant) != "float" and w.group_size % 16 == 0
    )
    return (_rounded_per_16(x) if integer else x) @ dequantize_np(w).T, integer


@pytest.mark.skipif(not quant_matmul_cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("variant", list(quant_matmul_cpu.VARIANTS))
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(
    "num_in,group,offset,scale_dtype",
    [
        (256, 256, False, np.float32),  # per channel: groups of whole vectors
        (576, 32, True, np.float16),  # GGUF's blocks (the demo model's width)
        (256, 16, False, np.float32),  # Q6_K's sub-blocks
        (512, 128, True, np.float16),  # our int4's groups
        (96, 32, False, np.float32),  # rows end inside a vector (masked loads)
        (48, 8, False, np.float32),  # groups finer than x's sub-blocks: the float path
    ],
)
def test_native_matmul_variants_match_their_reference(
    variant, fmt, num_in, group, offset, scale_dtype
):
    """Each build of the kernel this CPU can run: the integer paths (AVX-512 VNNI, AVX-VNNI)
    equal the dense matmul of x rounded to int8 per 16 inputs, up to float32 summation order,
    and stay within the rounding's error of the exact product; the float path equals the exact
    product. Rows alone give what they give in a batch."""
    if fmt == "int4" and group % 32:
        pytest.skip("int4 groups are whole 32-blocks")
    if not quant_matmul_cpu.available(variant):
        pytest.skip(f"the {variant} build is unavailable here")
    rng = np.random.default_rng(1)
    w = random_qarray(rng, fmt, 70, num_in, num_in // group, offset, scale_dtype)
    dense = dequantize_np(w)
    wj = jax.tree.map(jnp.asarray, w)
    matmul = jax.jit(
        lambda x, w: quant_matmul_cpu.quant_matmul_cpu(x, w.q, w.scale, w.offset, w.fmt, variant)
    )
    x = rng.standard_normal((19, num_in)).astype(np.float32)  # blocks of 8 or 4, and the rest
    x[3] = 0.0  # a row of zeros (scale 0) gives zeros
    got = np.asarray(matmul(x, wj))
    exact = x @ dense.T
    ref, integer = _native_product(x, w, variant)
    scale = np.abs(exact).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * scale)
    assert np.all(got[3] == 0)
    if integer:  # int8 rounding of x: about 0.4% of x's range per input
        assert 1e-4 * scale < np.abs(got - exact).max() < 2e-2 * scale
    for rows in ((0, 1), (5, 6), (1, 3), (2, 19)):  # batch-invariant: the same bits in any batch
        np.testing.assert_array_equal(np.asarray(matmul(x[slice(*rows)], wj)), got[slice(*rows)])


@pytest.mark.skipif(not quant_matmul_cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("variant", list(quant_matmul_cpu.VARIANTS))
@pytest.mark.parametrize(
    "fmt,group,offset,scale_dtype",
    [
        ("int4", 32, True, np.float16),
        ("int8", 576, False, np.float32),
        ("fp8", 576, False, np.float32),
    ],
)
def test_native_matmuls_in_one_call_equal_their_own_calls(variant, fmt, group, offset, scale_dtype):
    """Several matrices of one x in one call (a layer's q, k and v: different output sizes,
    some not filling a block of rows): each result is bit for bit its matrix's own call, at
    every row count; and `qmatmuls` makes that one call of the matrices that can share it."""
    if not quant_matmul_cpu.available(variant):
        pytest.skip(f"the {variant} build is unavailable here")
    rng = np.random.default_rng(2)
    ws = [
        jax.tree.map(
            jnp.asarray, random_qarray(rng, fmt, o, 576, 576 // group, offset, scale_dtype)
        )
        for o in (576, 70, 192)
    ]
    one = jax.jit(
        lambda x, w: quant_matmul_cpu.quant_matmul_cpu(x, w.q, w.scale, w.offset, w.fmt, variant)
    )
    many = jax.jit(
        lambda x, ws: quant_matmul_cpu.quant_matmuls_cpu(
            x, [(w.q, w.scale, w.offset) for w in ws], fmt, variant
        )
    )
    for t in (1, 3, 9):
        x = rng.standard_normal((t, 576)).astype(np.float32)
        for w, got in zip(ws, many(x, ws), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(one(x, w)))


def test_qmatmuls_shares_calls_only_between_alike_matrices():
    """One kernel call per set of matrices with the same format, group count, scale dtype and
    offsets; a matrix unlike the others gets its own; results as `qmatmul`'s."""
    if not quant_matmul_cpu.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(3)
    ws = [
        random_qarray(rng, "int4", 64, 128, 4, True, np.float16),
        random_qarray(rng, "int8", 32, 128, 1, False, np.float32),
        random_qarray(rng, "int4", 96, 128, 4, True, np.float16),
        random_qarray(rng, "int4", 16, 128, 2, True, np.float16),  # other group size
    ]
    ws = [jax.tree.map(jnp.asarray, w) for w in ws]
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    hlo = jax.jit(qmatmuls).lower(x, ws).as_text()
    assert hlo.count("jaxllm_quant_matmul") == 3, hlo
    for w, got in zip(ws, jax.jit(qmatmuls)(x, ws), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(qmatmul)(x, w)))
    with pytest.raises(ValueError, match="share G"):
        quant_matmul_cpu.quant_matmuls_cpu(
            x, [(w.q, w.scale, w.offset) for w in (ws[0], ws[3])], "int4"
        )


def test_int4_packing_is_gguf_q4_order_and_inverts():
    values = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
    packed = pack_int4(values)
    assert packed.shape == (1, 32)
    assert packed[0, 0] == values[0, 0] | (values[0, 16] << 4)  # element j and j + 16
    np.testing.assert_array_equal(unpack_int4(packed), values)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), values)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantize_error_is_bounded(fmt):
    """Rounding error at most half a step (int8: per channel; int4: per group, its range
    possibly clipped where that reconstructs better); fp8 within its 3-bit mantissa."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    qa = quantize(w, fmt)
    err = np.abs(dequantize_np(qa) - w)
    rel = np.linalg.norm(dequantize_np(qa) - w) / np.linalg.norm(w)
    if fmt == "int8":
        assert (err <= qa.scale / 2 + 1e-6).all()
        assert rel < 0.01
    elif fmt == "int4":
        assert qa.group_size == 32 and qa.scale.dtype == np.float16
        assert rel < 0.1
    else:
        assert rel < 0.04
    # Lookup rows and the matmul agree with the dequantized matrix.
    dev = jax.tree.map(jnp.asarray, qa)
    ids = jnp.asarray([0, 5, 47])
    np.testing.assert_allclose(take_rows(dev, ids), dequantize_np(qa)[[0, 5, 47]], rtol=1e-6)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    native = quant_matmul_cpu.available() and fmt != "fp8"
    want = _native_product(x, qa)[0] if native else x @ dequantize_np(qa).T
    np.testing.assert_allclose(qmatmul(x, dev), want, rtol=1e-4, atol=1e-4)


def test_int4_importance_refits_groups_to_the_weighted_error():
    """With `importance`, each group's scale and offset are refit to the importance-weighted
    squared error: never worse than the clip search alone by that measure, better overall on
    random weights, and the error moves to the inputs that matter less."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    importance = rng.uniform(0.0, 1.0, 128).astype(np.float32) ** 8  # as steep as the head's

    def weighted_errors(qa):  # per group of 32, and in all
        e = importance * np.square(dequantize_np(qa) - w)
        return e.reshape(64, 4, 32).sum(-1), e.sum()

    plain, plain_total = weighted_errors(quantize(w, "int4"))
    refit, refit_total = weighted_errors(quantize(w, "int4", importance=importance))
    assert (refit <= plain * (1 + 1e-6) + 1e-12).all()
    assert refit_total < 0.8 * plain_total, (refit_total, plain_total)
    qa = quantize(w, "int4", importance=np.ones(128, np.float32))
    assert qa.scale.dtype == np.float16 and qa.offset.dtype == np.float16


@pytest.fixture(scope="module")
def smollm2_path():
    from jaxllm.model_files import fetch_demo_model

    return fetch_demo_model("smollm2-135m")


class _FakeReader:
    def __init__(self, raw):
        self._raw = raw

    def raw(self, t):
        return self._raw


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_block_types_are_bit_exact(kind):
    """Random blocks of each type we keep: our integers times our factors are, bit for bit,
    the `gguf` package's dequantization (a Q4_0 zero may come out +0 where gguf's is -0:
    q * d - 8 * d against d * (q - 8); equal as numbers)."""
    import gguf

    from jaxllm.loaders import gguf as gguf_loader
    from jaxllm.loaders.gguf_file import TensorInfo

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 512
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # Half-precision factors: finite values (random bytes could be inf or NaN).
    halves = {"Q6_K": [208], "Q8_0": [0], "Q4_0": [0], "Q5_0": [0]}.get(kind, [0, 2])
    for at in halves:
        h = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        raw[..., at : at + 2] = h.view(np.uint8).reshape(rows, cols // block, 2)
    raw = raw.reshape(rows, -1)
    info = TensorInfo(name="w", shape=(rows, cols), ggml_type=int(qtype), offset=0)
    w = gguf_loader._quantized(_FakeReader(raw), info)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(rows, cols)
    got = dequantize_np(w)
    assert w.fmt == ("int4" if kind in ("Q4_0", "Q4_1", "Q4_K") else "int8")
    on_device = np.asarray(dequantize(jax.tree.map(jnp.asarray, w)))  # the XLA path's
    for values in (got, on_device):
        np.testing.assert_array_equal(
            np.where(values == 0, 0, values).view(np.uint32),
            np.where(ref == 0, 0, ref).view(np.uint32),
        )


def test_int4_head_keeps_the_first_rows_int8():
    """int4's output head: its first rows (a BPE vocabulary's most frequent tokens) in int8,
    exactly as int8 quantizes them, the rest as int4 with the head's importance; the matmul,
    the embedding lookup and the dequantization of the split matrix equal the parts'."""
    rng = np.random.default_rng(7)
    assert [head_int8_rows(v) for v in (100, 400, 32_000, 49_152, 151_936)] == [
        0, 32, 4000 // 32 * 32, 4096, 4096
    ]  # fmt: skip
    w = rng.normal(size=(1024, 64)).astype(np.float32)
    importance = rng.uniform(0.5, 2.0, 64).astype(np.float32) ** 8
    head = quantize_head(w, importance)
    assert isinstance(head, SplitRows) and head.shape == (1024, 64)
    assert (head.first.fmt, head.first.num_out, head.rest.fmt) == ("int8", 128, "int4")
    np.testing.assert_array_equal(
        dequantize_np(head.first), dequantize_np(quantize(w[:128], "int8"))
    )
    np.testing.assert_array_equal(
        dequantize_np(head.rest), dequantize_np(quantize(w[128:], "int4", importance=importance))
    )
    whole = dequantize_np(head)
    error = np.abs(whole - w)
    assert whole.shape == w.shape and error[:128].max() < error[128:].max() / 4
    x = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    on_device = jax.tree.map(jnp.asarray, head)
    parts = [qmatmul(x, on_device.first), qmatmul(x, on_device.rest)]  # each its kernel
    np.testing.assert_array_equal(
        np.asarray(qmatmul(x, on_device)), np.concatenate([np.asarray(p) for p in parts], -1)
    )
    ids = jnp.asarray([0, 127, 128, 1023, 5])
    np.testing.assert_array_equal(np.asarray(take_rows(on_device, ids)), whole[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(dequantize(on_device)), whole)
    assert isinstance(quantize_head(w[:100]), QArray)  # too few rows to split


def test_int4_model_head_is_split(tiny_model_dir):
    """Loaded with int4, a model's output head is split: int8 rows first."""
    from jaxllm.loaders import load_model

    loaded = load_model(tiny_model_dir, load_tokenizer=False, quantization="int4")
    model = loaded.model
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    table = head.get_value()
    assert isinstance(table, SplitRows) and table.first.fmt == "int8"
    assert table.first.num_out == head_int8_rows(loaded.config.vocab_size) > 0
    assert table.num_out == loaded.config.vocab_size


@pytest.mark.demo_model
@pytest.mark.slow
def test_demo_gguf_kept_quantized(smollm2_path):
    """SmolLM2's Q4_1 / Q8_0 tensors stay integers: bit-exact to the float loader's (which
    dequantizes with the gguf package, Q/K rows un-permuted), the model holds 0.18x the
    float32 bytes (float16 block factors), and its logits match the float model's: to float32
    summation through XLA's dequantization; through the CPU kernel's integer path (x rounded
    to 8 bits per 16 inputs, in every one of 211 matmuls) within a few percent, the greedy
    token the same at almost every position (its quality bar is the perplexity test's)."""
    import dataclasses

    from jaxllm.loaders import load_model
    from jaxllm.loaders.gguf import iter_gguf
    from jaxllm.sharding import per_device_bytes

    floats = dict(iter_gguf(smollm2_path))
    kept = 0
    for name, w in iter_gguf(smollm2_path, keep_quantized=True):
        if isinstance(w, QArray):
            kept += 1
            got = dequantize_np(w)
            np.testing.assert_array_equal(got.view(np.uint32), floats[name].view(np.uint32))
    assert kept == 1 + 30 * 7

    quant = load_model(smollm2_path, load_tokenizer=False, quantization="gguf")
    dense = load_model(smollm2_path, load_tokenizer=False, quantization="float")
    from flax import nnx

    q_bytes = per_device_bytes(nnx.state(quant.model))[1]
    f_bytes = per_device_bytes(nnx.state(dense.model))[1]
    assert q_bytes / f_bytes < 0.18, (q_bytes, f_bytes)
    tokens = list(range(100, 164))
    want = prefill_logits(dense.model, dense.config, tokens)
    native = quant.model.compilation
    quant.model.compilation = dataclasses.replace(native, quant_matmul_backend="xla")
    exact = prefill_logits(quant.model, quant.config, tokens)
    quant.model.compilation = native
    assert np.abs(exact - want).max() < 1e-3 * np.abs(want).max()
    assert (exact.argmax(-1) == want.argmax(-1)).all()
    if quant_matmul_cpu.path() != "float":  # the integer path: 0.7 of 30 measured (2-core EPYC)
        got = prefill_logits(quant.model, quant.config, tokens)
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.demo_model
@pytest.mark.parametrize(
    "fmt,limit",
    [("int8", 0.27), pytest.param("int4", 0.16, marks=pytest.mark.slow), ("fp8", 0.27)],
)
def test_demo_weight_bytes(smollm2_path, fmt, limit):
    """Bytes of weights, scales included, against float32 (the issue's bar): the embedding
    (the tied head) is quantized too."""
    from flax import nnx

    from jaxllm.loaders import load_model
    from jaxllm.sharding import per_device_bytes

    float_bytes = 134_515_008 * 4  # the demo model's parameters in float32
    model = load_model(smollm2_path, load_tokenizer=False, quantization=fmt).model
    assert per_device_bytes(nnx.state(model))[1] <= limit * float_bytes


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_tiny_model_logits_close_to_float(tiny_model_dir, fmt):
    from jaxllm.loaders import load_model

    dense = load_model(tiny_model_dir, load_tokenizer=False)
    quant = load_model(tiny_model_dir, load_tokenizer=False, quantization=fmt)
    tokens = list(range(3, 40))
    want = prefill_logits(dense.model, dense.config, tokens)
    got = prefill_logits(quant.model, quant.config, tokens)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    # int4: every matrix, the output head included (0.179 measured on this 64-wide random
    # model; 0.15 held while the head stayed int8). The quality bar is the demo model's
    # perplexity (test_demo_perplexity_and_greedy_agreement).
    assert rel < {"int8": 0.03, "int4": 0.2, "fp8": 0.1}[fmt], rel


@pytest.mark.parametrize(
    "fmt,kv_cache_dtype",
    [("int8", "auto"), ("int4", "auto"), ("fp8", "auto"), (None, "int8"), ("int4", "fp8")],
)
def test_engine_runs_quantized_without_compiling(tiny_model_dir, fmt, kv_cache_dtype):
    """Warmup compiles every program, each updating the (8-bit or float) KV cache in place; a
    mixed batch (prefill chunks, decodes) then compiles nothing, and gives each request the
    tokens it gets alone: the native kernels sum every output in the same order whatever the
    number of rows."""
    from jaxllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * k} for k in (1, 3, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(
        tiny_model_dir,
        quantization=fmt,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=128,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    before = llm.runner.num_compilations
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.runner.num_compilations == before
    assert batched == alone
    programs = [p for p in llm.runner.programs if p.updates_cache]
    assert programs and all(p.updates_in_place for p in programs)
    if kv_cache_dtype != "auto":
        assert llm.runner.kv_cache.scales is not None


def test_8bit_kv_cache_pages_at_equal_memory():
    """The pool gets the pages the saved bytes allow: an 8-bit cache (with its float32 scale
    per token and head) holds (4 * 64) / (64 + 4) = 3.8x the pages of float32 and 1.9x those of
    bfloat16 at head size 64, in the same budget."""
    from jaxllm.config import CacheConfig, ModelConfig
    from jaxllm.worker.kv_sizing import plan_kv_cache, resolve_kv_cache_dtype

    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=576, intermediate_size=64, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    )  # fmt: skip
    cache = CacheConfig(cpu_kv_cache_gib=0.5)
    pages = {
        name: plan_kv_cache(config, cache, resolve_kv_cache_dtype(name, "float32"), None)[0]
        for name in ("float32", "bfloat16", "int8", "fp8")
    }
    assert pages["int8"] == pages["fp8"]
    assert pages["int8"] / pages["float32"] == pytest.approx(256 / 68, rel=1e-3)
    assert pages["int8"] / pages["bfloat16"] == pytest.approx(128 / 68, rel=1e-3)


@pytest.mark.slow  # 1.5 minutes per format (test_tensor_parallel.py runs TP by default)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_tensor_parallel_same_tokens(tmp_path, tokenizer_dir, fmt):
    """Quantized weights and their scales split together: TP 1, 2, 4 give the same tokens,
    with nothing compiled after warmup and each device holding about 1/TP of them; so do an
    8-bit KV cache's data and scales (the int4 case runs with one)."""
    from conftest import write_tiny_checkpoint

    model = write_tiny_checkpoint(
        tmp_path / "tp", tokenizer_dir, num_heads=8, num_kv_heads=2, vocab_size=512
    )
    kv = ["--kv-cache-dtype", "int8"] if fmt == "int4" else []
    rows = tensor_parallel_report(model, "1,2,4", tmp_path, "--quantization", fmt, *kv)
    assert [r["same_tokens_as_first"] for r in rows] == [True] * 3
    assert [r["compiled_after_warmup"] for r in rows] == [0] * 3
    assert rows[2]["param_bytes_per_device"] < 0.4 * rows[0]["param_bytes"]
    if kv:  # 2 kv heads: one per device at TP 2, and at TP 4 (each repeated twice)
        whole = rows[0]["kv_bytes"]  # int8 data and f32 scales
        assert [r["kv_bytes_per_device"] for r in rows] == [whole, whole // 2, whole // 2]


@pytest.mark.slow
@pytest.mark.demo_model
def test_demo_perplexity_and_greedy_agreement(request):
    """The issue's quality bar on the committed held-out text (2,768 tokens): perplexity
    within 1% of float for int8, 5% for int4 on any text, here 3% (1.8% measured: texts not
    shown measure more) (3 minutes: `pytest -m slow`). The greedy divergence per prompt is
    printed, for the record (scripts/quant_quality.py)."""
    import sys
    from pathlib import Path

    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("pytest -m slow tests/test_quantization.py")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import quant_quality

    entries = ("float", "int8", "int4", "float:int8")
    rows = quant_quality.compare([quant_quality.measure("smollm2-135m", q) for q in entries])
    for e, r in zip(entries, rows, strict=True):
        print(e, r["perplexity"], r["first_divergence"])
    assert rows[0]["text_tokens"] >= 2000
    assert rows[1]["perplexity_ratio"] <= 1.01
    assert rows[2]["perplexity_ratio"] <= 1.03
    assert rows[3]["perplexity_ratio"] <= 1.01  # an int8 KV cache
