"""The gated delta rule's four forms (`pallas_kernels.gated_delta_rule`: the token-by-token
reference, the chunked XLA form, the GPU and the TPU kernels interpreted here) against the recurrence run in
float64 by numpy, over ragged batches, in the cases that break a careless chunked form: keys
at nearby positions nearly parallel with full writes and no decay (the chunk's triangular
inverse has large entries), and a decay strong enough that a chunk's cumulative log-decay
reaches hundreds (differences of large cumulative sums). transformers' own recurrence is
checked against the model's wrapper in tests/test_hybrid_models.py."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import GDN_BACKENDS, gated_delta_rule

# A prefill of two chunks and a bit, a decode row, a request of one whole chunk, a request
# with no token this step; then a padding request, and padding tokens.
LENS = [130, 1, 64, 0]
PAD_TOKENS = 5
CU_Q_LENS = np.concatenate([[0], np.cumsum(LENS), [sum(LENS)]]).astype(np.int32)
NUM_SEQS = np.array([len(LENS)], np.int32)


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _inputs(case: str, heads: int = 2, dk: int = 32, dv: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    t = sum(LENS) + PAD_TOKENS
    if case == "parallel_keys":
        k = _l2(rng.normal(size=(1, heads, dk)) + 0.01 * rng.normal(size=(t, heads, dk)))
        g, b = np.zeros((t, heads)), np.ones((t, heads))
    elif case == "strong_decay":
        k = _l2(rng.normal(size=(t, heads, dk)))
        g, b = -rng.uniform(0, 8, size=(t, heads)), rng.uniform(size=(t, heads))
    else:
        k = _l2(rng.normal(size=(t, heads, dk)))
        g, b = -rng.uniform(0, 0.2, size=(t, heads)), rng.uniform(size=(t, heads))
    q = _l2(rng.normal(size=(t, heads, dk))) * dk**-0.5
    v = rng.normal(size=(t, heads, dv))
    initial = rng.normal(size=(len(LENS) + 1, heads, dk, dv))
    return q, k, v, g, b, initial


def _float64_truth(q, k, v, g, b, initial):
    cu = CU_Q_LENS
    out, final = np.zeros(v.shape), initial.copy()
    for r in range(len(LENS)):
        s = initial[r].copy()
        for i in range(cu[r], cu[r + 1]):
            s = s * np.exp(g[i])[:, None, None]
            u = b[i][:, None] * (v[i] - np.einsum("hkv,hk->hv", s, k[i]))
            s = s + k[i][:, :, None] * u[:, None, :]
            out[i] = np.einsum("hkv,hk->hv", s, q[i])
        final[r] = s
    return out, final


def _transformers_chunked_errors(q, k, v, g, b, initial) -> tuple[float, float]:
    """The largest errors of transformers' chunked form (`torch_chunk_gated_delta_rule`,
    float32, chunks of 64) on each request alone, against the float64 truth: (outputs,
    states)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    want, want_final = _float64_truth(q, k, v, g, b, initial)
    cu = CU_Q_LENS
    worst = worst_state = 0.0
    for r in range(len(LENS)):
        span = slice(cu[r], cu[r + 1])
        if cu[r] == cu[r + 1]:
            continue
        args = (q[span] * q.shape[-1] ** 0.5, k[span], v[span], g[span], b[span])  # it scales q
        got, state = ref.torch_chunk_gated_delta_rule(
            *(torch.from_numpy(x[None].astype(np.float32)) for x in args),
            initial_state=torch.from_numpy(initial[r][None].astype(np.float32)),
            output_final_state=True,
        )
        worst = max(worst, float(np.abs(got[0].numpy() - want[span]).max()))
        worst_state = max(worst_state, float(np.abs(state[0].numpy() - want_final[r]).max()))
    return worst, worst_state


@pytest.mark.parametrize("case", ["parallel_keys", "strong_decay", "random"])
@pytest.mark.parametrize("backend", GDN_BACKENDS)
def test_every_form_equals_the_float64_recurrence(backend, case):
    inputs = _inputs(case)
    out, final = gated_delta_rule(
        *(x.astype(np.float32) for x in inputs), CU_Q_LENS, NUM_SEQS, backend=backend
    )
    out, final = np.asarray(out), np.asarray(final)
    want_out, want_final = _float64_truth(*inputs)
    n = sum(LENS)
    # No further from the truth than transformers' own chunked form is (twice its error), or
    # within float32's 1e-6 of the scale: a chunk's decays are differences of cumulative sums,
    # which float32 rounds at the sums' size when the decay is strong.
    theirs_out, theirs_state = _transformers_chunked_errors(*inputs)
    out_bound = max(2 * theirs_out, 1e-6 * np.abs(want_out).max())
    state_bound = max(2 * theirs_state, 1e-6 * np.abs(want_final).max())
    np.testing.assert_allclose(out[:n], want_out[:n], atol=out_bound)
    np.testing.assert_allclose(final[: len(LENS)], want_final[: len(LENS)], atol=state_bound)
    assert not out[n:].any()  # padding tokens give nothing
    # The request without a token and the padding request keep their state exactly.
    np.testing.assert_array_equal(final[3:], inputs[-1][3:].astype(np.float32))


@pytest.mark.parametrize("chunk", [8, 48])
def test_chunk_must_be_a_power_of_two_of_at_least_16(chunk):
    inputs = [x.astype(np.float32) for x in _inputs("random")]
    with pytest.raises(ValueError, match="chunk"):
        gated_delta_rule(*inputs, CU_Q_LENS, NUM_SEQS, backend="chunked", chunk=chunk)


def test_an_unknown_form_is_refused_by_name():
    inputs = [x.astype(np.float32) for x in _inputs("random")]
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_delta_rule(*inputs, CU_Q_LENS, NUM_SEQS, backend="fla")


def test_the_tpu_kernels_inverse_by_doubling_is_exact_where_neumann_is_not():
    """(I + A)^-1 by doubling (the TPU kernel's) for a chunk of nearly parallel keys with full
    writes, whose inverse has entries in the tens of thousands, and a random one: as close to
    numpy's float64 inverse as float32 forward substitution is."""
    import jax.numpy as jnp

    from pallas_kernels.gated_delta_rule import _unit_lower_inverse
    from pallas_kernels.gated_delta_rule_tpu import doubling_inverse

    rng = np.random.default_rng(3)
    c = 64
    k = _l2(rng.normal(size=(1, 32)) + 0.01 * rng.normal(size=(c, 32)))
    for a in (np.tril(k @ k.T, -1), np.tril(rng.normal(size=(c, c)) * 0.3, -1)):
        want = np.linalg.inv(np.eye(c) + a)
        got = np.asarray(doubling_inverse(jnp.asarray(a, jnp.float32)), np.float64)
        substitution = np.asarray(_unit_lower_inverse(jnp.asarray(a, jnp.float32)), np.float64)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= max(2 * np.abs(substitution - want).max(), 1e-6 * scale)
        assert np.array_equal(np.triu(got, 1), np.zeros((c, c)))


@pytest.mark.parametrize("seed", range(4))
def test_the_tpu_kernels_work_items_cover_every_prefill_token_once(seed):
    """Random ragged batches (decode rows, prefills of any length, empty and padding requests):
    the TPU kernel's work items are each request's tokens past its first, in order, in chunks,
    first and last marked, never more than the bound its scalar memory is sized by."""
    from pallas_kernels.gated_delta_rule_tpu import _FIRST, _LAST, max_work_items, work_items

    rng = np.random.default_rng(seed)
    chunk, num_reqs, num_tokens = 16, 12, 96
    lens = rng.choice([0, 1, 1, 2, 17, 33], size=num_reqs)
    while lens.sum() > num_tokens:
        lens[rng.integers(num_reqs)] //= 2
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    count, req, begin, size, flags = (
        np.asarray(x) for x in work_items(starts, lens.astype(np.int32), num_tokens, chunk)
    )
    assert len(req) == max_work_items(num_tokens, num_reqs, chunk)
    n = int(count[0])
    covered = [t for i in range(n) for t in range(begin[i], begin[i] + size[i])]
    want = [t for r in range(num_reqs) for t in range(starts[r] + 1, starts[r] + lens[r])]
    assert covered == want
    assert (size[:n] >= 1).all() and (size[:n] <= chunk).all() and not size[n:].any()
    for r in set(req[:n]):
        mine = np.flatnonzero(req[:n] == r)
        assert flags[mine[0]] & _FIRST and flags[mine[-1]] & _LAST
        assert not any(flags[i] & _FIRST for i in mine[1:])
        assert not any(flags[i] & _LAST for i in mine[:-1])
    assert not flags[n:].any()


def test_the_tpu_kernel_under_the_tpu_simulator():
    """The TPU kernel's DMAs and semaphores (double-buffered fetches, output writes that
    overlap the next item's rows, states loaded and stored) under Pallas' TPU simulator, with
    race detection on and uninitialized memory filled with NaN: no race, no NaN, the truth."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    inputs = _inputs("random")
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out, final = gated_delta_rule(
        *(x.astype(np.float32) for x in inputs),
        CU_Q_LENS,
        NUM_SEQS,
        backend="pallas_tpu",
        interpret=params,
        chunk=16,  # many items: both buffer slots, requests of several items
    )
    out, final = np.asarray(out), np.asarray(final)
    races = interpret_pallas_call.races
    assert races is not None and not races.races_found, "the simulator found a data race"
    want_out, want_final = _float64_truth(*inputs)
    n = sum(LENS)
    assert not np.isnan(out).any() and not np.isnan(final).any()
    assert not out[n:].any()
    np.testing.assert_allclose(out[:n], want_out[:n], atol=1e-5)
    np.testing.assert_allclose(final[: len(LENS)], want_final[: len(LENS)], atol=1e-5)
    np.testing.assert_array_equal(final[3:], inputs[-1][3:].astype(np.float32))
