"""DeepSeek's multi-head latent attention and routing.

`mla_paged_attention` (the absorbed form, over the paged cache of paired rows, by every
backend: the plain JAX form, and the GPU's and the TPU's kernels interpreted on the CPU)
against a dense float64 oracle
of the expanded form: per-head keys `[c W_UK | k_pe]` and values `c W_UV` built from the same
latents, causal softmax per request. The cache holds only what `write_latent` wrote into the
slot read; every other slot is NaN (or, in the other layer slots, garbage rows at the same
offsets), so a read outside a request's written rows, or of another layer, poisons or changes
the output.

DeepSeek-V2/V3 routing (`MoE.route`) against transformers' `DeepseekV3TopkRouter` and
`DeepseekV2TopkRouter` with the same weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from jaxllm.config import ModelConfig
from jaxllm.models.moe import MoE
from pallas_kernels import (
    KVCache,
    get_kv_cache_shape,
    mla_paged_attention,
    write_latent,
    zeros_kv_cache,
)
from pallas_kernels import mla_attention as mla_module

from helpers import dense_attention

# (q_len, seq_len) per request: a decode with a long context, a chunked prefill with context,
# a whole prefill, and a decode of a first token. Contexts of 202 and 156 tokens take several
# chunks of the context loop (`_CHUNK_TOKENS` = 64), and the block tables (with two spare
# columns: 28 pages of 8 or 15 of 16) are not a whole number of chunks.
SEQS = [(1, 203), (24, 180), (37, 37), (1, 1)]
MAX_REQS = 6  # two padding requests past num_seqs
T_PAD = 72  # padding query rows past cu_q_lens[num_seqs]
NUM_LAYERS, SLOT = 3, 1  # the rows live in slot 1; slots 0 and 2 hold garbage
HEADS, NOPE, V_DIM = 2, 16, 12


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _empty_cache(shape, dtype):
    """A cache of `shape` whose every slot reads NaN until written: a float cache filled with
    NaN, an 8-bit one with NaN scales (and, for fp8, NaN bytes, 0x7f in e4m3)."""
    if dtype == jnp.float32:
        return jnp.full(shape, jnp.nan, jnp.float32)
    cache = zeros_kv_cache(shape, dtype)
    data = cache.data
    if dtype == jnp.float8_e4m3fn:
        data = jnp.full_like(data, 0x7F)
    return KVCache(data, jnp.full_like(cache.scales, jnp.nan))


def _mla_case(
    seed,
    *,
    latent,
    rope,
    page_size,
    cache_dtype=jnp.float32,
    head_dim=None,
    layer=SLOT,
    jit=False,
    backend="reference",
):
    """Builds the ragged batch `SEQS`, writes every token's row [c | k_pe] with `write_latent`
    into shuffled pages of layer slot `layer` (garbage rows at the same slots of the other
    layers, NaN everywhere else), and runs `mla_paged_attention` (under `jax.jit` with `jit`,
    the layer slot then a traced argument).

    Returns (raw output f32[T_PAD, N, L], output projected by W_UV [T_PAD, N, V], the float64
    oracle [T_PAD, N, V] computed from the rows as stored (dequantized where the cache is
    8-bit), the rows as written f32[tokens, L + R], the rows as stored)."""
    rng = np.random.default_rng(seed)
    width = latent + rope
    head_dim = head_dim or width // 2
    pages_per_seq = max(_cdiv(kv, page_size) for _, kv in SEQS) + 2  # spare columns
    num_pages = sum(_cdiv(kv, page_size) for _, kv in SEQS) + 5
    perm = rng.permutation(num_pages)
    spare = perm[-5:]  # never written: NaN (what the spare block-table columns point at)
    block_tables = rng.choice(spare, (MAX_REQS, pages_per_seq)).astype(np.int32)
    seq_lens = np.zeros(MAX_REQS, np.int32)
    cu = np.zeros(MAX_REQS + 1, np.int32)
    rows, slots, q_nope, q_pe = [], [], [], []
    used = 0
    for r, (q_len, kv_len) in enumerate(SEQS):
        n = _cdiv(kv_len, page_size)
        pages = perm[used : used + n]
        used += n
        block_tables[r, :n] = pages
        t = np.arange(kv_len)
        slots.append(pages[t // page_size] * page_size + t % page_size)
        rows.append(rng.standard_normal((kv_len, width)).astype(np.float32))
        q_nope.append(rng.standard_normal((q_len, HEADS, NOPE)).astype(np.float32))
        q_pe.append(rng.standard_normal((q_len, HEADS, rope)).astype(np.float32))
        seq_lens[r] = kv_len
        cu[r + 1] = cu[r] + q_len
    cu[len(SEQS) + 1 :] = cu[len(SEQS)]
    total = int(cu[len(SEQS)])
    # Keys and values of unit scale per element, so the logits are O(1).
    w_uk = (rng.standard_normal((latent, HEADS, NOPE)) / np.sqrt(latent)).astype(np.float32)
    w_uv = (rng.standard_normal((latent, HEADS, V_DIM)) / np.sqrt(latent)).astype(np.float32)
    sm_scale = (NOPE + rope) ** -0.5

    # Queries: padding rows past `total` hold arbitrary finite values.
    qn = rng.standard_normal((T_PAD, HEADS, NOPE)).astype(np.float32)
    qp = rng.standard_normal((T_PAD, HEADS, rope)).astype(np.float32)
    qn[:total], qp[:total] = np.concatenate(q_nope), np.concatenate(q_pe)

    shape = get_kv_cache_shape(NUM_LAYERS, num_pages, page_size, 1, head_dim, latent=True)
    cache = _empty_cache(shape, cache_dtype)
    all_rows, all_slots = np.concatenate(rows), np.concatenate(slots).astype(np.int32)
    for other in range(NUM_LAYERS):
        if other != layer:  # the same slots of the other layers: large garbage rows
            garbage = 100 * rng.standard_normal(all_rows.shape).astype(np.float32)
            cache = _write(cache, other, garbage, all_slots, latent)
    # Three padding rows with a slot past the pool: dropped, they must write nothing.
    pad_slot = num_pages * page_size
    written = np.concatenate([all_rows, np.full((3, width), 7.0, np.float32)])
    written_slots = np.concatenate([all_slots, np.full(3, pad_slot, np.int32)])
    cache = _write(cache, layer, written, written_slots, latent)

    ql = jnp.einsum(
        "tnp,lnp->tnl", jnp.asarray(qn), jnp.asarray(w_uk), precision=jax.lax.Precision.HIGHEST
    )
    attend = functools.partial(mla_paged_attention, sm_scale=sm_scale, backend=backend)
    if jit:
        attend = jax.jit(attend)
    out = attend(
        ql,
        jnp.asarray(qp),
        cache,
        layer,
        jnp.asarray(seq_lens),
        jnp.asarray(block_tables),
        jnp.asarray(cu),
        jnp.asarray([len(SEQS)], jnp.int32),
    )
    assert out.shape == (T_PAD, HEADS, latent) and out.dtype == jnp.float32
    out = np.asarray(out)
    projected = np.einsum("tnl,lnv->tnv", out.astype(np.float64), w_uv.astype(np.float64))

    stored = _stored_rows(cache, layer, all_slots, latent, rope)
    expect = np.zeros((T_PAD, HEADS, V_DIM))
    start = 0
    for r, (q_len, kv_len) in enumerate(SEQS):
        row = stored[start : start + kv_len].astype(np.float64)
        start += kv_len
        c, k_pe = row[:, :latent], row[:, latent:]
        keys = np.concatenate(
            [
                np.einsum("sl,lnp->snp", c, w_uk.astype(np.float64)),
                np.broadcast_to(k_pe[:, None, :], (kv_len, HEADS, rope)),
            ],
            axis=-1,
        )
        values = np.einsum("sl,lnv->snv", c, w_uv.astype(np.float64))
        q = np.concatenate([q_nope[r], q_pe[r]], axis=-1).astype(np.float64)
        expect[cu[r] : cu[r + 1]] = dense_attention(q, keys, values, q_len, sm_scale)
    return out, projected, expect, all_rows, stored


def _write(cache, layer, rows, slots, latent):
    rows = jnp.asarray(rows)[:, None]  # one copy
    return write_latent(cache, layer, rows[..., :latent], rows[..., latent:], jnp.asarray(slots))


def _stored_rows(cache, layer, slots, latent, rope) -> np.ndarray:
    """The rows [c | k_pe] at `slots` of layer slot `layer` as stored: float32, dequantized
    where the cache is 8-bit, read from the pair rows (the `mla_attention` module doc) by
    numpy, not by the module's own reader."""
    data, scales = cache if isinstance(cache, KVCache) else (cache, None)
    data = np.asarray(data)
    if data.dtype == np.uint8:
        data = data.view(jnp.float8_e4m3fn)
    data = data.astype(np.float32)
    page_size = 2 * data.shape[3]
    page, offset = slots // page_size, slots % page_size
    pair = data[layer, page, 0, offset // 2]  # [S, lanes]
    odd = (offset % 2)[:, None]
    cols = np.arange(latent)[None, :] + odd * latent
    c = np.take_along_axis(pair, cols, axis=1)
    cols = 2 * latent + np.arange(rope)[None, :] + odd * rope
    rows = np.concatenate([c, np.take_along_axis(pair, cols, axis=1)], axis=1)
    if scales is not None:
        rows = rows * np.asarray(scales)[layer, page, 0, offset][:, None]
    return rows


def _check(out, projected, expect, tol):
    total = sum(q for q, _ in SEQS)
    assert np.all(out[total:] == 0), "padding query rows must read nothing"
    scale = np.abs(expect).max()
    np.testing.assert_allclose(projected, expect, rtol=tol, atol=tol * scale)


# The plain JAX form, and the GPU's Triton and the TPU's Mosaic kernels interpreted on the CPU.
BACKENDS = ["reference", "pallas_gpu", "pallas_tpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("latent,rope", [(40, 8), (512, 64)], ids=["40+8", "512+64"])
def test_matches_expanded_attention(latent, rope, page_size, backend):
    """A ragged batch (decode with a long context, chunked prefill, whole prefill, first-token
    decode, padding requests and query rows) in a float32 cache gives the expanded form's
    causal attention within float32 rounding, reading only its layer slot's written rows."""
    out, projected, expect, rows, stored = _mla_case(
        0, latent=latent, rope=rope, page_size=page_size, backend=backend
    )
    np.testing.assert_array_equal(stored, rows)  # a float32 cache keeps the rows exactly
    _check(out, projected, expect, 1e-5)


@pytest.mark.parametrize(
    "cache_dtype,latent,rope,page_size",
    [
        (jnp.int8, 40, 8, 8),
        (jnp.int8, 512, 64, 16),
        (jnp.float8_e4m3fn, 40, 8, 16),
        (jnp.float8_e4m3fn, 512, 64, 8),
    ],
    ids=["int8-40+8", "int8-512+64", "fp8-40+8", "fp8-512+64"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_8bit_cache_matches_dequantized_rows(cache_dtype, latent, rope, page_size, backend):
    """An int8 or fp8 cache quantizes each row with one scale; attention over it
    equals the oracle over the rows dequantized (so the only error is float32 rounding), and
    the quantization really changed them (the comparison is not against the float rows)."""
    out, projected, expect, rows, stored = _mla_case(
        1, latent=latent, rope=rope, page_size=page_size, cache_dtype=cache_dtype,
        backend=backend,
    )  # fmt: skip
    assert not np.allclose(stored, rows, rtol=1e-4, atol=0)
    # Each row's largest element is kept exactly (the scale is its amax / qmax).
    np.testing.assert_allclose(np.abs(stored).max(-1), np.abs(rows).max(-1), rtol=1e-6)
    _check(out, projected, expect, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8], ids=["f32", "int8"])
def test_wide_cache_lanes(cache_dtype, backend):
    """A cache whose pair rows are wider than two rows (a platform's padded lanes) holds them
    with zeros past them, and attention reads the same rows: the same result as a cache of
    exactly two rows' width."""
    latent, rope, page_size = 40, 8, 16
    narrow = _mla_case(
        2, latent=latent, rope=rope, page_size=page_size, cache_dtype=cache_dtype, backend=backend
    )
    wide = _mla_case(
        2,
        latent=latent,
        rope=rope,
        page_size=page_size,
        cache_dtype=cache_dtype,
        head_dim=(latent + rope) // 2 + 8,
        backend=backend,
    )
    np.testing.assert_array_equal(wide[4], narrow[4])  # the same rows stored
    _check(*wide[:3], 1e-5)
    np.testing.assert_allclose(wide[0], narrow[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8], ids=["f32", "int8"])
def test_tpu_kernel_under_the_tpu_simulator(monkeypatch, cache_dtype):
    """The TPU kernel's DMAs and semaphores in small blocks (two pages of 8 per KV block, so
    many blocks and both buffer slots; work items of 4 tokens): no race, uninitialized VMEM
    (NaN) never read, the same result."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    kernel = mla_module.mla_paged_attention_tpu

    def small_blocks(*args, **kwargs):
        return kernel(*args, **{**kwargs, "interpret": params, "kv_tokens": 16, "max_rows": 8})

    monkeypatch.setattr(mla_module, "mla_paged_attention_tpu", small_blocks)
    out, projected, expect, _, _ = _mla_case(
        5, latent=40, rope=8, page_size=8, cache_dtype=cache_dtype, backend="pallas_tpu"
    )
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found, "the simulator found a data race"
    _check(out, projected, expect, 1e-5)


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_tpu_kernel_lowers_at_deepseek_v3_shapes(num_heads, cache_dtype):
    """The TPU kernel lowers to a Mosaic custom call at V3's row (512 + 64) and head counts
    (128 on one chip, 16 a device under TP8); the real compiler's check is in
    test_accelerator_compile."""
    shape = get_kv_cache_shape(2, 64, 16, 1, 288, "tpu", latent=True)
    assert shape == (2, 64, 1, 8, 1152)  # two 576-wide rows per pair row: no padding
    cache = zeros_kv_cache(shape, cache_dtype, "tpu")
    ql = jnp.zeros((8, num_heads, 512), jnp.bfloat16)
    q_pe = jnp.zeros((8, num_heads, 64), jnp.bfloat16)
    meta = (
        jnp.full((4,), 40, jnp.int32),
        jnp.zeros((4, 4), jnp.int32),
        jnp.array([0, 5, 6, 7, 8], jnp.int32),
        jnp.array([4], jnp.int32),
    )
    fn = functools.partial(mla_paged_attention, sm_scale=0.1, backend="pallas_tpu", interpret=False)
    text = jax.jit(fn).trace(ql, q_pe, cache, 1, *meta).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in text.as_text()


def test_context_chunks_of_one_page(monkeypatch):
    """With a byte budget that allows only one page per context chunk (26 trips round the
    online softmax for the longest context) the result is the same, also compiled with the
    layer slot a traced argument."""
    monkeypatch.setattr(mla_module, "_CHUNK_BYTES", 1)
    out, projected, expect, _, _ = _mla_case(3, latent=40, rope=8, page_size=8, layer=2, jit=True)
    _check(out, projected, expect, 1e-5)


def test_rejects_caches_that_cannot_hold_the_row():
    """A cache of several kv heads, or pair rows narrower than two rows, is refused."""
    ql, q_pe = jnp.zeros((4, 2, 40)), jnp.zeros((4, 2, 8))
    meta = (
        jnp.array([4], jnp.int32),
        jnp.zeros((1, 1), jnp.int32),
        jnp.array([0, 4], jnp.int32),
        jnp.array([1], jnp.int32),
    )
    for shape in [(1, 2, 2, 4, 96), (1, 2, 1, 4, 80)]:
        with pytest.raises(ValueError, match="latent attention"):
            mla_paged_attention(ql, q_pe, jnp.zeros(shape), 0, *meta, sm_scale=1.0)


# --- routing against transformers -----------------------------------------------------------

HIDDEN, TOKENS = 32, 64


def _routers(arch: str, *, seed: int = 0, bias_scale: float = 0.0, x_dtype=jnp.float32, **kw):
    """transformers' router and our `MoE` built from one config (`kw` over a small base) with
    the same random router weight (and V3's correction bias, `bias_scale` times a normal);
    returns (ours: (weights, expert ids) as numpy, transformers' router, the input as torch)."""
    torch = pytest.importorskip("torch")
    import transformers

    v3 = arch == "DeepseekV3ForCausalLM"
    config_class = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    base = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=16,
        moe_intermediate_size=8,
        vocab_size=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
    )
    hf_config = config_class(**(base | kw))
    config = ModelConfig.from_hf_config(hf_config.to_dict() | {"architectures": [arch]})
    if v3:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router,
        )
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as Router,
        )
    rng = np.random.default_rng(seed)
    num_experts = hf_config.n_routed_experts
    weight = (rng.standard_normal((num_experts, HIDDEN)) * 0.3).astype(np.float32)
    bias = (rng.standard_normal(num_experts) * bias_scale).astype(np.float32)
    hf = Router(hf_config)
    moe = MoE(config, dtype=x_dtype, mesh=None, rngs=nnx.Rngs(0))
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(weight))
        if v3:
            hf.e_score_correction_bias.copy_(torch.from_numpy(bias))
    moe.router.set_value(jnp.asarray(weight.T))  # HF [E, D] -> ours [D, E]
    if v3:
        moe.score_bias.set_value(jnp.asarray(bias))
    else:
        assert moe.score_bias is None
    x = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), x_dtype)
    x_torch = torch.from_numpy(np.array(x.astype(jnp.float32)))
    if x_dtype == jnp.bfloat16:
        x_torch = x_torch.to(torch.bfloat16)
    weights, experts = moe.route(x)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    return (np.asarray(weights), np.asarray(experts)), hf, x_torch


def _hf_route(hf, x_torch):
    """transformers' (weights, expert ids) as numpy."""
    import torch

    with torch.no_grad():
        _, weights, experts = hf(x_torch)
    return weights.float().numpy(), experts.numpy()


def _assert_same_routing(ours, theirs):
    """The same expert set per token (in any order) with the same weight for each expert."""
    (w, e), (hw, he) = ours, theirs
    order, horder = np.argsort(e, -1), np.argsort(he, -1)
    np.testing.assert_array_equal(
        np.take_along_axis(e, order, -1), np.take_along_axis(he, horder, -1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(w, order, -1), np.take_along_axis(hw, horder, -1), rtol=1e-6, atol=1e-6
    )


def _sets(experts: np.ndarray) -> list[frozenset]:
    return [frozenset(row.tolist()) for row in experts]


@pytest.mark.parametrize(
    "norm_topk_prob,n_group,topk_group,x_dtype",
    [
        (True, 4, 2, jnp.float32),
        (False, 4, 2, jnp.float32),
        (True, 1, 1, jnp.float32),
        (False, 8, 3, jnp.float32),
        (True, 4, 2, jnp.bfloat16),
    ],
    ids=["norm-groups", "unnormalised-groups", "norm-one-group", "unnormalised-8groups", "bf16"],
)
def test_deepseek_v3_routing_matches_transformers(norm_topk_prob, n_group, topk_group, x_dtype):
    """V3's router (sigmoid scores, correction bias, best groups by their two best experts,
    renormalised or not, scaled) chooses the same experts with the same weights as
    transformers', for float32 and bfloat16 inputs."""
    ours, hf, x = _routers(
        "DeepseekV3ForCausalLM",
        bias_scale=0.05,
        x_dtype=x_dtype,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
    )
    _assert_same_routing(ours, _hf_route(hf, x))
    if norm_topk_prob:
        np.testing.assert_allclose(ours[0].sum(-1), 2.5, rtol=1e-6)


def test_deepseek_v3_correction_bias_changes_the_choice():
    """A large correction bias chooses other experts than the scores alone would, while the
    weights stay the unbiased scores: ours still agrees with transformers, and the same router
    without the bias chooses differently for some tokens (so the bias is really applied)."""
    kw = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    ours, hf, x = _routers("DeepseekV3ForCausalLM", bias_scale=0.5, **kw)
    _assert_same_routing(ours, _hf_route(hf, x))
    unbiased, hf_unbiased, _ = _routers("DeepseekV3ForCausalLM", bias_scale=0.0, **kw)
    _assert_same_routing(unbiased, _hf_route(hf_unbiased, x))
    changed = sum(a != b for a, b in zip(_sets(ours[1]), _sets(unbiased[1]), strict=True))
    assert changed > TOKENS // 4, changed


def test_deepseek_v3_groups_restrict_the_choice():
    """With n_group 4 and topk_group 2 every token's experts lie in at most 2 groups of 4, and
    for some tokens that differs from choosing among all experts (n_group 1)."""
    kw = dict(bias_scale=0.05, norm_topk_prob=True, routed_scaling_factor=1.0)
    grouped, hf, x = _routers("DeepseekV3ForCausalLM", n_group=4, topk_group=2, **kw)
    _assert_same_routing(grouped, _hf_route(hf, x))
    assert max(len(set((row // 4).tolist())) for row in grouped[1]) <= 2
    free, hf_free, _ = _routers("DeepseekV3ForCausalLM", n_group=1, topk_group=1, **kw)
    _assert_same_routing(free, _hf_route(hf_free, x))
    assert _sets(grouped[1]) != _sets(free[1])


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_matches_transformers(topk_method):
    """V2's router (softmax scores, greedy or within the groups whose best expert is best,
    scaled, not renormalised) chooses the same experts with the same weights as transformers'.
    Greedy ignores the config's groups; group-limited greedy keeps each token's experts in
    `topk_group` groups, which differs from greedy for some tokens."""
    kw = dict(n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=1.5)
    ours, hf, x = _routers("DeepseekV2ForCausalLM", topk_method=topk_method, **kw)
    _assert_same_routing(ours, _hf_route(hf, x))
    if topk_method == "group_limited_greedy":
        assert max(len(set((row // 4).tolist())) for row in ours[1]) <= 2
        greedy, _, _ = _routers("DeepseekV2ForCausalLM", topk_method="greedy", **kw)
        assert _sets(ours[1]) != _sets(greedy[1])
