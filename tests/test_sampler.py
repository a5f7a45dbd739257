"""The on-device sampler: greedy, top-k / top-p / min-p support, per-request seeds, logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sampler import SamplingInputs, _filter, sample


def inputs(r, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0):
    return SamplingInputs(
        temperature=jnp.full((r,), temperature, jnp.float32),
        top_k=jnp.full((r,), top_k, jnp.int32),
        top_p=jnp.full((r,), top_p, jnp.float32),
        min_p=jnp.full((r,), min_p, jnp.float32),
        seeds=jnp.tile(jnp.array([[seed, 0]], jnp.uint32), (r, 1)),
        counters=jnp.full((r,), counter, jnp.int32),
        blocked_ids=jnp.full((r, 4), 10**6, jnp.int32),
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


def test_sampling_follows_the_distribution_and_seeds():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    logits = jnp.log(jnp.asarray(np.maximum(probs, 1e-12), jnp.float32))
    r = 4000
    s = inputs(r)
    s = SamplingInputs(
        **{
            **s.__dict__,
            "seeds": jnp.stack([jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.uint32)], 1),
        }
    )
    out = sample(jnp.tile(logits, (r, 1)), s, all_greedy=False, num_logprobs=0)
    freq = np.bincount(np.asarray(out.sampled), minlength=4) / r
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # Same seed and counter -> same draw, whatever the row; another counter -> a fresh draw.
    a = sample(
        jnp.tile(logits, (8, 1)), inputs(8, seed=42, counter=3), all_greedy=False, num_logprobs=0
    )
    assert len(set(np.asarray(a.sampled).tolist())) == 1


def test_greedy_rows_and_logprobs():
    logits = jax.random.normal(jax.random.key(0), (3, 50))
    s = inputs(3, temperature=0.0)
    out = sample(logits, s, all_greedy=False, num_logprobs=5)
    np.testing.assert_array_equal(out.sampled, jnp.argmax(logits, -1))
    lp = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(out.logprob, lp.max(-1), rtol=1e-6)
    assert (np.asarray(out.rank) == 1).all()
    np.testing.assert_allclose(out.top_logprobs, jax.lax.top_k(lp, 5)[0], rtol=1e-6)
    fast = sample(logits, s, all_greedy=True, num_logprobs=0)
    np.testing.assert_array_equal(fast.sampled, out.sampled)


def _numpy_filter(x, top_k, top_p, min_p):
    """The sort-based definition: top-k, then top-p on the renormalised rest, then min-p."""
    keep = np.ones_like(x, bool)
    order = np.argsort(-x)
    if top_k > 0:
        keep[order[top_k:]] = False
    z = np.where(keep, x, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        sp = p[order]
        n = int(np.searchsorted(np.cumsum(sp), top_p) + 1)  # smallest prefix reaching top_p
        keep[order[n:]] = False
    if min_p > 0:
        keep &= x >= x.max() + np.log(min_p)
    return keep


def test_filter_matches_sort_based_definition():
    rng = np.random.default_rng(0)
    r, v = 24, 3000
    x = (rng.standard_normal((r, v)) * 3).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 50, 2999], size=r)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], size=r)
    min_p = rng.choice([0.0, 0.0, 0.05], size=r)
    s = SamplingInputs(
        temperature=jnp.ones(r, jnp.float32),
        top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32),
        min_p=jnp.asarray(min_p, jnp.float32),
        seeds=jnp.zeros((r, 2), jnp.uint32),
        counters=jnp.zeros(r, jnp.int32),
        blocked_ids=jnp.full((r, 4), v, jnp.int32),
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


def test_blocked_ids_and_tiny_temperatures():
    logits = jnp.array([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]], jnp.float32)
    s = inputs(2, temperature=0.0)
    s = SamplingInputs(**{**s.__dict__, "blocked_ids": jnp.array([[1, 4, 4, 4], [4, 4, 4, 4]])})
    out = sample(logits, s, all_greedy=False, num_logprobs=2)
    assert np.asarray(out.sampled).tolist() == [2, 1]  # row 0 may not pick token 1
    # Logprobs stay those of the raw distribution.
    np.testing.assert_allclose(
        out.top_logprobs[0], jax.nn.log_softmax(logits[0])[jnp.array([1, 2])]
    )
    # A temperature too small to divide by is greedy, not NaN.
    big = jnp.array([[35.0, 0.0, 40.0, 0.0]], jnp.float32)
    tiny = sample(big, inputs(1, temperature=1e-37), all_greedy=False, num_logprobs=0)
    assert int(tiny.sampled[0]) == 2
