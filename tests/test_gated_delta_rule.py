"""The gated delta rule's three forms (`pallas_kernels.gated_delta_rule`: the token-by-token
reference, the chunked XLA form, the GPU kernel interpreted here) against the recurrence run in
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
