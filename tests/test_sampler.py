"""The on-device sampler: greedy, top-k / top-p / min-p support, per-request seeds, logprobs,
penalties and logit bias."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxllm.worker.compiler import launches
from jaxllm.worker.sampler import (
    NUM_CANDIDATES,
    SamplerVariant,
    SamplingInputs,
    _apply_penalties,
    _candidate_cut,
    _filter,
    argmax,
    sample,
)


def inputs(
    r, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0, seq_len=8,
    logprobs=False, vocab=2**16,
):  # fmt: skip
    """Sampling inputs for r rows; no blocked ids, no bias, no penalties."""
    return SamplingInputs(
        temperature=jnp.full((r,), temperature, jnp.float32),
        top_k=jnp.full((r,), top_k, jnp.int32),
        top_p=jnp.full((r,), top_p, jnp.float32),
        min_p=jnp.full((r,), min_p, jnp.float32),
        seeds=jnp.tile(jnp.array([[seed, 0]], jnp.uint32), (r, 1)),
        counters=jnp.full((r,), counter, jnp.int32),
        logprobs=jnp.full((r,), logprobs, jnp.bool_),
        blocked_ids=jnp.full((r, 4), 10**6, jnp.int32),
        logit_bias_ids=jnp.full((r, MAX_LOGIT_BIAS), 10**6, jnp.int32),
        logit_bias=jnp.zeros((r, MAX_LOGIT_BIAS), jnp.float32),
        presence_penalty=jnp.zeros((r,), jnp.float32),
        frequency_penalty=jnp.zeros((r,), jnp.float32),
        repetition_penalty=jnp.ones((r,), jnp.float32),
        history_ids=jnp.full((r, seq_len), 10**6, jnp.int32),
        num_prompt_tokens=jnp.zeros((r,), jnp.int32),
        token_bitmask=jnp.full((r, -(-vocab // 32)), -1, jnp.int32),
    )


def test_filter_top_k_top_p_min_p():
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    x = jnp.log(jnp.asarray(probs, jnp.float32))[None]
    kept = lambda **kw: np.isfinite(np.asarray(_filter(x, inputs(1, **kw))))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.5) == [True, True, False, False, False]  # 0.4 < 0.5: needs the 2nd
    assert kept(top_p=0.4) == [True, False, False, False, False]
    assert kept(top_p=0.9) == [True, True, True, True, False]
    assert kept(min_p=0.5) == [True, True, False, False, False]  # >= 0.2
    assert kept(top_k=3, top_p=0.6) == [True, True, False, False, False]
    assert kept() == [True] * 5
    # Issue 13, defect 10: min-p comes first, as in vLLM V1, and top-p renormalises what it
    # kept: min-p 0.3 keeps 0.4, 0.3, 0.15 (0.47, 0.35, 0.18 renormalised), and 0.47 + 0.35
    # reaches top-p 0.8 (top-p first needed the third token: 0.4 + 0.3 < 0.8).
    assert kept(min_p=0.3, top_p=0.8) == [True, True, False, False, False]


def test_top_k_holds_with_blocked_ids():
    """Issue 13, defect 2: with a blocked id (-inf while min_tokens holds) in the row, the
    full-vocabulary top-k (k past the candidates) used to keep everything."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 300)), jnp.float32).at[:, 5].set(-jnp.inf)
    k = NUM_CANDIDATES + 36
    kept = np.isfinite(np.asarray(_filter(x, inputs(2, top_k=k))))
    assert kept.sum(axis=-1).tolist() == [k, k]
    assert not kept[:, 5].any()
    everything = np.isfinite(np.asarray(_filter(x, inputs(2, top_k=299))))
    assert everything.sum(axis=-1).tolist() == [299, 299]


def test_sampling_follows_the_distribution_and_seeds():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    logits = jnp.log(jnp.asarray(np.maximum(probs, 1e-12), jnp.float32))
    r = 4000
    s = dataclasses.replace(
        inputs(r),
        seeds=jnp.stack([jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.uint32)], 1),
    )
    out = sample(jnp.tile(logits, (r, 1)), s)
    freq = np.bincount(np.asarray(out.sampled), minlength=4) / r
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # Same seed and counter -> same draw, whatever the row; another counter -> a fresh draw.
    a = sample(jnp.tile(logits, (8, 1)), inputs(8, seed=42, counter=3))
    assert len(set(np.asarray(a.sampled).tolist())) == 1


def test_greedy_rows_and_logprobs():
    logits = jax.random.normal(jax.random.key(0), (3, 50))
    s = inputs(3, temperature=0.0, logprobs=True)
    out = sample(logits, s)
    np.testing.assert_array_equal(out.sampled, jnp.argmax(logits, -1))
    lp = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(out.logprob, lp.max(-1), rtol=1e-6)
    assert (np.asarray(out.rank) == 1).all()
    np.testing.assert_allclose(out.top_logprobs[:, :5], jax.lax.top_k(lp, 5)[0], rtol=1e-6)
    # Without logprobs: the same tokens, and no logprob work (zeros).
    plain = sample(logits, inputs(3, temperature=0.0))
    np.testing.assert_array_equal(plain.sampled, out.sampled)
    assert not np.asarray(plain.logprob).any()


def _numpy_filter(x, top_k, top_p, min_p):
    """The sort-based definition, in vLLM V1's order: min-p, then top-k, then top-p on the
    renormalised rest."""
    keep = np.ones_like(x, bool)
    if min_p > 0:
        keep &= x >= x.max() + np.log(min_p)
    order = np.argsort(-np.where(keep, x, -np.inf), kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    z = np.where(keep, x, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        sp = p[order]
        n = int(np.searchsorted(np.cumsum(sp), top_p) + 1)  # smallest prefix reaching top_p
        keep[order[n:]] = False
    return keep


def test_filter_matches_sort_based_definition():
    rng = np.random.default_rng(0)
    r, v = 24, 3000
    x = (rng.standard_normal((r, v)) * 3).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 50, 2999], size=r)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], size=r)
    min_p = rng.choice([0.0, 0.0, 0.05], size=r)
    s = dataclasses.replace(
        inputs(r),
        top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32),
        min_p=jnp.asarray(min_p, jnp.float32),
    )
    kept = np.isfinite(np.asarray(_filter(jnp.asarray(x), s)))
    for i in range(r):
        expect = _numpy_filter(x[i].astype(np.float64), top_k[i], top_p[i], min_p[i])
        assert (kept[i] == expect).all(), (
            i,
            top_k[i],
            top_p[i],
            min_p[i],
            kept[i].sum(),
            expect.sum(),
        )


def test_compiled_sampler_sorts_nothing_of_vocabulary_size():
    """Top-k stays XLA's TopK call: a top_k whose result is sliced twice compiles on the CPU to
    a sort of the whole vocabulary (what made one sampled row cost 10 ms on the demo model)."""
    r, v = 4, 4096
    hlo = jax.jit(sample).lower(jnp.zeros((r, v)), inputs(r)).compile().as_text()
    sorts = [line for line in hlo.splitlines() if " sort(" in line and f",{v}]" in line]
    assert not sorts, sorts


@pytest.mark.parametrize("vocab", [300, 4096, 49152, 151936, 32003, 20])
def test_argmax_is_the_first_index_of_the_maximum(vocab):
    """Over vocabularies viewed as blocks (49152, 151936), padded (300, the prime 32003) or
    one block (20): the first index of the maximum, as jnp.argmax, ties across blocks too."""
    x = np.random.default_rng(vocab).standard_normal((7, vocab)).astype(np.float32)
    x[1, [3, vocab - 2]] = 50.0  # a tie: the first wins
    x[2] = -np.inf  # all blocked: index 0, as jnp.argmax
    x[3, vocab - 1] = 99.0  # the last id
    x[4, [vocab // 2 + 1, vocab // 2]] = 7.0  # a tie, maybe across a block boundary
    x[5, :] = 1.0  # all equal
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.tolist() == np.argmax(x, axis=-1).tolist()
    assert got[1] == 3 and got[3] == vocab - 1 and got[5] == 0


def test_greedy_sampling_makes_no_array_of_the_logits_size():
    """A greedy batch's compiled head-and-sampler program makes one [R, V] array, the logits:
    the sampler's optional parts stay inside their `lax.cond` branches and the argmax makes no
    broadcast maximum or index array of that size (each a pass over memory as large as the
    logits: 80 ms of a 64-row step at V = 49152 on a 2-core CPU, where the head took 8)."""
    r, v, d = 64, 49152, 16
    program = jax.jit(lambda h, w, s: sample(h @ w, s).sampled)
    hlo = program.lower(jnp.zeros((r, d)), jnp.zeros((d, v)), inputs(r, temperature=0.0, vocab=v))
    text = hlo.compile().as_text()
    entry = text[text.index("\nENTRY") :]
    made = []
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(", line)
        if m and m.group(2) == f"{r},{v}" and m.group(3) not in _VIEWS:
            made.append(f"{m.group(1)} ({m.group(3)})")
    assert len(made) == 1, made


# Instructions that make no new array: the argument, views of it, and the `lax.cond` whose
# branches hand back their operand (or make theirs inside the branch).
_VIEWS = ("parameter", "get-tuple-element", "bitcast", "conditional")


def test_candidate_cut_matches_sort_based_definition_where_covered():
    """The fast path's kept set, for every row it claims, equals the sort-based definition; and
    it claims the rows it should (top-k within the candidates, a top-p or min-p cut inside
    them), leaving plain temperature sampling and larger top-k to the full path."""
    rng = np.random.default_rng(1)
    r, v = 48, 5000
    scale = rng.choice([0.5, 3.0, 8.0], size=r)[:, None]  # flat to peaked distributions
    x = (rng.standard_normal((r, v)) * scale).astype(np.float32)
    top_k = rng.choice([0, 1, 7, NUM_CANDIDATES, NUM_CANDIDATES + 1, 4000], size=r)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.05], size=r)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.2], size=r)
    top_k[:3], top_p[:3], min_p[:3] = 0, 1.0, 0.0  # plain temperature sampling
    top_k[3] = NUM_CANDIDATES  # exactly the candidates
    x[4, : NUM_CANDIDATES + 5] = 9.0  # ties across the candidates' edge
    top_k[4], top_p[4], min_p[4] = NUM_CANDIDATES, 1.0, 0.0
    s = dataclasses.replace(
        inputs(r),
        top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32),
        min_p=jnp.asarray(min_p, jnp.float32),
    )
    vals, ids, keep, covered = (np.asarray(a) for a in _candidate_cut(jnp.asarray(x), s))
    for i in range(r):
        expect = _numpy_filter(x[i].astype(np.float64), top_k[i], top_p[i], min_p[i])
        if covered[i]:
            got = np.zeros(v, bool)
            got[ids[i][keep[i]]] = True
            assert (got == expect).all(), (i, top_k[i], top_p[i], min_p[i])
        else:  # left to the full path only when it may be needed: something past the
            # candidates is kept, or a top-k past them (top-p's normaliser is then unknown),
            # or the tie across the edge
            needed = expect.sum() > keep[i].sum() or top_k[i] > NUM_CANDIDATES or i == 4
            assert needed, (i, top_k[i], top_p[i], min_p[i], expect.sum())
    assert not covered[:3].any(), "plain temperature sampling needs the whole vocabulary"
    assert not covered[4], "a tie across the candidates' edge needs the whole vocabulary"
    small_k = (top_k > 0) & (top_k < NUM_CANDIDATES)
    assert covered[small_k].all()
    assert covered.sum() > r // 2


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=0.9),  # candidates: the prefix ends inside
        dict(top_k=3),  # candidates: top-k
        dict(),  # the full path: plain temperature
        dict(top_k=NUM_CANDIDATES + 10),  # the full path: a top-k past the candidates
        dict(min_p=0.05),  # candidates: min-p
    ],
)
def test_draws_follow_the_filtered_distribution(params):
    """Empirical frequencies over 4000 seeds against the filtered softmax, on a vocabulary
    larger than the candidates, for each way a row can be drawn."""
    v, r = 200, 4000
    base = np.log(np.linspace(1.0, 0.01, v) ** 3).astype(np.float32)  # a smooth long tail
    s = dataclasses.replace(
        inputs(r, temperature=1.0, **params),
        seeds=jnp.stack([jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.uint32)], 1),
    )
    out = np.asarray(sample(jnp.tile(jnp.asarray(base), (r, 1)), s).sampled)
    keep = _numpy_filter(
        base.astype(np.float64),
        params.get("top_k", 0),
        params.get("top_p", 1.0),
        params.get("min_p", 0.0),
    )
    p = np.where(keep, np.exp(base - base.max()), 0.0)
    p /= p.sum()
    assert keep[out].all(), "a filtered-out token was drawn"
    freq = np.bincount(out, minlength=v) / r
    # Compare the cumulative distributions (Kolmogorov-Smirnov, ~1.6/sqrt(n) at 1%).
    assert np.abs(np.cumsum(freq) - np.cumsum(p)).max() < 1.6 / np.sqrt(r)


def test_a_row_draws_the_same_token_whatever_shares_its_batch():
    """The full-vocabulary path turns off the cut-offs of rows it does not draw for, and skips
    a bisection no row needs: each row of a mixed batch draws what it draws alone."""
    v = 200
    base = np.log(np.linspace(1.0, 0.01, v) ** 3).astype(np.float32)
    rows = [
        dict(top_p=0.9),  # candidates
        dict(),  # full path, no cut-off
        dict(top_k=NUM_CANDIDATES + 10, top_p=0.8),  # full path, both bisections
        dict(temperature=0.0),  # greedy
        dict(top_k=NUM_CANDIDATES + 10),  # full path, top-k only
        dict(min_p=0.05, top_p=0.95),  # candidates
    ]

    def batch(params: list[dict], seed: int):
        one = [inputs(1, **{"temperature": 1.0, **p}) for p in params]
        s = jax.tree.map(lambda *xs: jnp.concatenate(xs), *one)
        seeds = jnp.array([[seed, 0]] * len(params), jnp.uint32)
        logits = jnp.tile(jnp.asarray(base), (len(params), 1))
        return np.asarray(jitted(logits, dataclasses.replace(s, seeds=seeds)).sampled)

    jitted = jax.jit(sample)  # two programs (6 rows, 1 row) instead of each op eagerly
    for seed in range(8):
        mixed = batch(rows, seed)
        alone = [batch([p], seed)[0] for p in rows]
        assert mixed.tolist() == alone, seed


def test_blocked_ids_and_tiny_temperatures():
    logits = jnp.array([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]], jnp.float32)
    s = inputs(2, temperature=0.0, logprobs=True)
    s = dataclasses.replace(s, blocked_ids=jnp.array([[1, 4, 4, 4], [4, 4, 4, 4]]))
    out = sample(logits, s)
    assert np.asarray(out.sampled).tolist() == [2, 1]  # row 0 may not pick token 1
    # Logprobs stay those of the raw distribution.
    np.testing.assert_allclose(
        out.top_logprobs[0, :2], jax.nn.log_softmax(logits[0])[jnp.array([1, 2])]
    )
    # A temperature too small to divide by is greedy, not NaN.
    big = jnp.array([[35.0, 0.0, 40.0, 0.0]], jnp.float32)
    tiny = sample(big, inputs(1, temperature=1e-37))
    assert int(tiny.sampled[0]) == 2


def _numpy_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties for one row, written out on numpy arrays."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, int), minlength=len(x))
    seen = counts > 0
    seen[np.asarray(prompt, int)] = True
    p = np.where(seen, repetition, 1.0)
    x = np.where(x > 0, x / p, x * p)
    x -= frequency * counts
    x -= presence * (counts > 0)
    return x


def _penalty_case(rng, r, v, seq_len):
    """Random logits, histories and per-row penalties (some rows neutral, some single ones)."""
    logits = (rng.standard_normal((r, v)) * 3).astype(np.float32)
    history = np.full((r, seq_len), v, np.int32)
    num_prompt = np.zeros(r, np.int32)
    rows = []
    for i in range(r):
        n = int(rng.integers(1, seq_len + 1))
        p = int(rng.integers(0, n + 1))
        ids = rng.integers(0, 12 if i % 2 else v, size=n)  # odd rows: many repeats
        history[i, :n] = ids
        num_prompt[i] = p
        rows.append((ids[:p], ids[p:]))
    presence = rng.uniform(-2, 2, r).astype(np.float32)
    frequency = rng.uniform(-2, 2, r).astype(np.float32)
    repetition = rng.uniform(0.05, 2, r).astype(np.float32)
    presence[0], frequency[0], repetition[0] = 0, 0, 1  # a neutral row
    frequency[1], repetition[1] = 0, 1  # presence only
    presence[2], repetition[2] = 0, 1  # frequency only
    presence[3], frequency[3] = 0, 0  # repetition only
    s = dataclasses.replace(
        inputs(r, seq_len=seq_len),
        presence_penalty=jnp.asarray(presence),
        frequency_penalty=jnp.asarray(frequency),
        repetition_penalty=jnp.asarray(repetition),
        history_ids=jnp.asarray(history),
        num_prompt_tokens=jnp.asarray(num_prompt),
    )
    expect = np.stack(
        [
            _numpy_penalties(logits[i], *rows[i], presence[i], frequency[i], repetition[i])
            for i in range(r)
        ]
    )
    return logits, s, expect


def test_penalties_match_vllm_formula():
    rng = np.random.default_rng(0)
    logits, s, expect = _penalty_case(rng, r=16, v=500, seq_len=64)
    got = np.asarray(_apply_penalties(jnp.asarray(logits), s))
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])  # the neutral row is untouched
    # Through the sampler: greedy rows pick the argmax of the penalized logits.
    s = dataclasses.replace(
        s, temperature=jnp.zeros(16, jnp.float32), logprobs=jnp.ones(16, jnp.bool_)
    )
    out = sample(jnp.asarray(logits), s)
    np.testing.assert_array_equal(out.sampled, expect.argmax(-1))
    # Logprobs stay those of the raw logits.
    np.testing.assert_allclose(
        out.top_logprobs[:, :3], jax.lax.top_k(jax.nn.log_softmax(logits, -1), 3)[0], rtol=1e-5
    )


def test_logit_bias_adds_before_penalties_and_temperature():
    v = 50
    logits = jax.random.normal(jax.random.key(1), (3, v))
    ids = np.full((3, MAX_LOGIT_BIAS), v, np.int32)
    bias = np.zeros((3, MAX_LOGIT_BIAS), np.float32)
    ids[0, :2], bias[0, :2] = [7, 9], [100.0, -100.0]  # force 7
    ids[1, :1], bias[1, :1] = [int(jnp.argmax(logits[1]))], [-100.0]  # ban the argmax
    s = dataclasses.replace(
        inputs(3, temperature=0.0),
        logit_bias_ids=jnp.asarray(ids),
        logit_bias=jnp.asarray(bias),
    )
    out = sample(logits, s)
    expect = np.asarray(logits).copy()
    for i in range(3):
        for t, b in zip(ids[i], bias[i], strict=True):
            if t < v:
                expect[i, t] += b
    np.testing.assert_array_equal(out.sampled, expect.argmax(-1))
    assert int(out.sampled[0]) == 7
    # Random rows too: +100 leaves nothing else in the running at any temperature.
    hot = dataclasses.replace(s, temperature=jnp.full(3, 2.0, jnp.float32))
    assert int(sample(logits, hot).sampled[0]) == 7
    # Bias first, then the repetition penalty (vLLM's order): 7's logit ~ 100 + x is
    # divided by the penalty, not (x / penalty) + 100.
    rep = dataclasses.replace(
        s,
        repetition_penalty=jnp.full(3, 2.0, jnp.float32),
        history_ids=jnp.full((3, 8), 7, jnp.int32),
        num_prompt_tokens=jnp.full(3, 8, jnp.int32),
        temperature=jnp.ones(3, jnp.float32),
    )
    one = jax.tree.map(lambda a: a[:1], rep)
    biased = jnp.asarray(logits[:1]).at[0, 7].add(100.0).at[0, 9].add(-100.0)
    got = _apply_penalties(biased, one)
    np.testing.assert_allclose(got[0, 7], (logits[0, 7] + 100.0) / 2.0, rtol=1e-6)


def test_rows_without_penalties_are_unchanged():
    """Penalties off gives bit-identical draws, whether or not other rows use them."""
    rng = np.random.default_rng(3)
    r, v = 8, 300
    logits, s, _ = _penalty_case(rng, r=r, v=v, seq_len=32)
    logits = jnp.asarray(logits)
    seeds = jnp.stack([jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.uint32)], 1)
    temps = jnp.asarray([0.0, 0.7, 1.0, 0.0, 1.3, 0.5, 0.0, 1.0], jnp.float32)
    plain = dataclasses.replace(
        inputs(r, top_p=0.9, seq_len=32, logprobs=True), seeds=seeds, temperature=temps
    )
    base = sample(logits, plain)
    # Row 0 of `s` is neutral: give the others neutral values too except row 5.
    one = dataclasses.replace(
        s,
        seeds=seeds,
        temperature=temps,
        top_p=plain.top_p,
        logprobs=plain.logprobs,
        presence_penalty=jnp.zeros(r).at[5].set(1.0),
        frequency_penalty=jnp.zeros(r).at[5].set(1.0),
        repetition_penalty=jnp.ones(r).at[5].set(1.5),
    )
    mixed = sample(logits, one)
    keep = np.arange(r) != 5
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(mixed), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(b)[keep])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)}, "logit_bias"),
    ],
)
def test_penalty_and_bias_validation_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_penalty_defaults_are_off():
    p = SamplingParams(logit_bias={})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias is None and not p.uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS), -100)).logit_bias


def _mixed_batch(vocab: int) -> tuple[jax.Array, SamplingInputs]:
    """Logits and inputs of 12 rows that need every part of the sampler: greedy rows (one with
    logprobs, one with a blocked id, one with a bias), and random rows with each cut-off alone
    and together (top-k inside and past the candidates, top-p, min-p, plain temperature), with
    penalties, a grammar bitmask and logprobs."""
    r = 12
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((r, vocab)) * 3, jnp.float32)
    s = inputs(r, seq_len=16, vocab=vocab)
    col = lambda *v: jnp.asarray(v)  # noqa: E731
    words = -(-vocab // 32)
    mask = np.full((r, words), -1, np.int32)
    mask[9, :] = 0x0F0F0F0F  # the grammar allows half the tokens
    history = np.full((r, 16), vocab, np.int32)
    history[10, :5] = [1, 2, 3, 3, 4]
    return x, dataclasses.replace(
        s,
        temperature=col(0, 0, 0, 0, 0.7, 1.0, 0.8, 1.3, 0.9, 1.0, 1.1, 0.6).astype(jnp.float32),
        top_k=col(0, 0, 0, 0, 5, NUM_CANDIDATES + 40, 0, 0, 20, 0, 0, 0).astype(jnp.int32),
        top_p=col(1, 1, 1, 1, 1, 1, 0.9, 1, 0.95, 0.8, 1, 0.99).astype(jnp.float32),
        min_p=col(0, 0, 0, 0, 0, 0, 0, 0.05, 0.01, 0, 0, 0).astype(jnp.float32),
        seeds=jnp.stack([jnp.arange(r, dtype=jnp.uint32), jnp.full(r, 3, jnp.uint32)], 1),
        logprobs=col(0, 1, 0, 0, 1, 0, 0, 1, 0, 1, 0, 0).astype(bool),
        blocked_ids=s.blocked_ids.at[2, 0].set(int(jnp.argmax(x[2]))),
        logit_bias_ids=s.logit_bias_ids.at[3, 0].set(11),
        logit_bias=s.logit_bias.at[3, 0].set(100.0),
        repetition_penalty=s.repetition_penalty.at[10].set(1.3),
        frequency_penalty=s.frequency_penalty.at[10].set(0.5),
        presence_penalty=s.presence_penalty.at[10].set(0.4),
        history_ids=jnp.asarray(history),
        num_prompt_tokens=s.num_prompt_tokens.at[10].set(2),
        token_bitmask=jnp.asarray(mask),
    )


GPU_VARIANTS = SamplerVariant.for_platform("gpu")


@pytest.mark.parametrize("vocab", [300, 4096])
def test_gpu_variants_sample_as_the_program_that_skips(vocab):
    """A variant without run-time skips (a GPU's) computes each part on every row and masks:
    the tokens, and the logprobs of the rows that ask, equal the skipping program's, for a batch
    that needs everything, and for batches that need only what the smaller variants hold."""
    x, s = _mixed_batch(vocab)
    want = jax.device_get(sample(x, s))
    got = jax.device_get(sample(x, s, GPU_VARIANTS[-1]))
    np.testing.assert_array_equal(got.sampled, want.sampled)
    asked = np.asarray(s.logprobs)
    for field in ("logprob", "rank", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(got, field)[asked], getattr(want, field)[asked])
    assert want.sampled[2] != int(jnp.argmax(x[2])) and want.sampled[3] == 11
    # Each smaller variant on a batch that needs no more than it holds.
    plain = inputs(12, seq_len=16, vocab=vocab)
    batches = {
        "greedy": dataclasses.replace(plain, temperature=jnp.zeros(12)),
        "logprobs": dataclasses.replace(plain, temperature=jnp.zeros(12), logprobs=s.logprobs),
        "random": dataclasses.replace(
            plain, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
            seeds=s.seeds,
        ),
    }  # fmt: skip
    for variant in GPU_VARIANTS[:-1]:
        batch = batches[variant.name]
        want = jax.device_get(sample(x, batch))
        got = jax.device_get(sample(x, batch, variant))
        np.testing.assert_array_equal(got.sampled, want.sampled, err_msg=variant.name)
        lp = np.asarray(batch.logprobs)
        np.testing.assert_array_equal(got.logprob[lp], want.logprob[lp], err_msg=variant.name)


def test_gpu_sampler_variants_hold_no_control_flow():
    """Every GPU variant's compiled program holds no `conditional` and no `while` (XLA:GPU
    stops the host on each: a sync inside every step), while the CPU's one program skips its
    parts under conditionals; the variants are tried smallest first, the last holds all."""
    x, s = _mixed_batch(4096)
    for variant in GPU_VARIANTS:
        text = jax.jit(functools.partial(sample, variant=variant)).lower(x, s).compile()
        syncs, kernels = launches(text.as_text())
        assert syncs == 0, variant
        assert kernels > 0
    cpu = SamplerVariant.for_platform("cpu")
    assert len(cpu) == 1 and cpu[0].skips
    assert launches(jax.jit(sample).lower(x, s).compile().as_text())[0] > 0
    assert GPU_VARIANTS[-1].covers(SamplerVariant())
    greedy = SamplerVariant(modify=False, random=False, logprobs=False)
    first = lambda needs: next(v for v in GPU_VARIANTS if v.covers(needs))  # noqa: E731
    assert first(greedy).name == "greedy"
    assert first(dataclasses.replace(greedy, logprobs=True)).name == "logprobs"
    assert first(dataclasses.replace(greedy, random=True)).name == "random"
    assert first(dataclasses.replace(greedy, random=True, logprobs=True)) == GPU_VARIANTS[-1]
    assert first(dataclasses.replace(greedy, modify=True)) == GPU_VARIANTS[-1]
