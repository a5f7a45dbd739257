"""The on-device sampler: per-request parameters arrive as arrays, so one compiled program
serves any mix of greedy and random requests.

Randomness is per request: request r's draw comes from a key derived from its own seed and the
number of tokens it has sampled so far, so the same seed gives the same text whatever else
shares the batch. Logprobs are those of the model's raw distribution (before penalties, logit
bias, temperature and top-k/p), as vLLM returns them by default.

The order is vLLM's: the grammar's token bitmask (structured outputs: a token it does not allow
is -inf), blocked ids (min_tokens) and logit bias, then the repetition, frequency
and presence penalties, then greedy argmax or temperature, min-p, top-k, top-p and the draw
(vLLM V1 applies min-p as a logits processor, before its top-k/top-p sampler). So
a greedy request's argmax sees its penalties and bias.

Work that follows the batch, in one of two ways (`SamplerVariant`): the optional parts (the
bitmask; blocked ids, bias and penalties; the random draw; logprobs) are either held by one
program and each run under `lax.cond` only when some row of the batch asks for it (CPU and TPU,
where a conditional runs in line or on the device: an all-greedy batch without logprobs pays
for one argmax and a few predicates), or compiled into a few variants the host picks from, each
running every part it holds on every row, masked (NVIDIA GPUs: XLA:GPU runs a conditional by
copying its predicate to the host and waiting for the device, a host sync inside every step that
would also cancel the overlap of async scheduling; a GPU program of the sampler holds no
`conditional` and no `while`).

The random draw is exact and sorts nothing of the vocabulary's size. Each random row's
candidates are its top `NUM_CANDIDATES` scaled logits (`lax.top_k`, in order). Top-k, top-p (on
the distribution renormalised to what min-p and top-k keep) and min-p are cut-offs along that
sorted list, each a threshold on the values (`_cut`: a next cut-off is its threshold and one
call), and one uniform number per row picks a token by inverse CDF over what is kept. A row
whose kept set provably lies inside its candidates (top-k <= NUM_CANDIDATES, or the top-p
prefix or the min-p cut ends inside them) is done there. Any other row (plain temperature
sampling, or a top-k larger than the candidates) takes the full-vocabulary path, also exact:
threshold cut-offs found by bisection (`_filter`; each only when such a row asks for it, so
plain temperature sampling bisects nothing) and a two-level inverse CDF (which block of the
vocabulary, then which token of it), again one uniform number per row. The path before this one
drew V Gumbel numbers per row and ran two 32-step bisections over [R, V] for every random batch
(3.5 ms for one row of V = 49152 on a 2-core CPU).

Penalties need, per request, which tokens its prompt and output hold: they arrive as the
request's whole token sequence (`history_ids`, padded to max_model_len, the longest a sequence
can be) and become a [R, V] seen-mask and output counts by a scatter on device. Sending the
ids, not a host-built [R, V] count array, keeps the transfer at R x max_model_len int32
(2 MiB for 64 x 8192) instead of R x V (12 MiB for 64 x 49152) and scales with the sequence,
not the vocabulary. Measured on a 2-core CPU at R=64, V=49152, S=8192: ~10 ms with penalties on
every row, plus 10-20 ms on the host to fill 64 full histories.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.sampling_params import MAX_LOGPROBS, SAMPLING_EPS

NUM_CANDIDATES = 64  # candidates per random row (a top-k up to this is cut exactly among them)
_CDF_BLOCK = 256  # tokens per block of the full-vocabulary inverse CDF
_BISECT_STEPS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    temperature: jax.Array  # f32[R]  0 = greedy
    top_k: jax.Array  # i32[R]  0 = off
    top_p: jax.Array  # f32[R]  1 = off
    min_p: jax.Array  # f32[R]  0 = off
    seeds: jax.Array  # u32[R, 2]  the request's 64-bit seed, low and high words
    counters: jax.Array  # i32[R]  tokens the request has sampled so far
    logprobs: jax.Array  # bool[R]  the request wants logprobs of what it samples
    blocked_ids: jax.Array  # i32[R, B]  ids that may not be sampled (min_tokens); >= V pads
    logit_bias_ids: jax.Array  # i32[R, MAX_LOGIT_BIAS]  ids to bias; >= V pads
    logit_bias: jax.Array  # f32[R, MAX_LOGIT_BIAS]  added to those ids' logits
    presence_penalty: jax.Array  # f32[R]  0 = off
    frequency_penalty: jax.Array  # f32[R]  0 = off
    repetition_penalty: jax.Array  # f32[R]  1 = off
    history_ids: jax.Array  # i32[R, S]  prompt then output ids (rows with penalties); >= V pads
    num_prompt_tokens: jax.Array  # i32[R]  how many of history_ids are the prompt
    # i32[R, ceil(V / 32)]  structured outputs: bit i of word w allows token 32 w + i; -1
    # (every bit set) allows all
    token_bitmask: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    sampled: jax.Array  # i32[R]
    logprob: jax.Array  # f32[R]     the sampled token's logprob (read only where asked for)
    rank: jax.Array  # i32[R]     its rank in the distribution, 1 = most likely
    top_ids: jax.Array  # i32[R, MAX_LOGPROBS]  the most likely alternatives, best first
    top_logprobs: jax.Array  # f32[R, MAX_LOGPROBS]


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """Which optional parts a sampler program holds, and how it runs them: static, a part of
    the program's key. A part not held is not compiled (the batch must not need it: the host
    picks a variant that `covers` the batch's needs)."""

    modify: bool = True  # the grammar bitmask, blocked ids, logit bias, penalties
    random: bool = True  # temperature sampling with its top-k, top-p and min-p cut-offs
    logprobs: bool = True  # the sampled token's logprob and rank, and the top alternatives
    # Each part held runs under `lax.cond` only when some row of the batch needs it; without
    # `skips`, every part held runs on every row (rows that do not need it are masked, their
    # results those of the part skipped), and the program holds no `conditional` or `while`:
    # what a GPU step needs (see the module's docstring).
    skips: bool = True

    @property
    def name(self) -> str:
        parts = [p for p in ("modify", "random", "logprobs") if getattr(self, p)]
        return "+".join(parts) or "greedy"

    def covers(self, needs: SamplerVariant) -> bool:
        """Whether this program holds every part `needs` asks for."""
        return all(getattr(self, p) or not getattr(needs, p) for p in _PARTS)

    @staticmethod
    def for_platform(platform: str) -> tuple[SamplerVariant, ...]:
        """The variants a runner compiles on `platform` ("cpu", "tpu", "gpu"/"cuda"), in the
        order the host tries them (the first that covers a batch serves it): one holding
        everything with run-time skips off GPUs; on GPUs, greedy, greedy with logprobs,
        random sampling, and everything, with none skipped at run time."""
        if platform not in ("gpu", "cuda", "rocm"):
            return (SamplerVariant(),)
        return (
            SamplerVariant(modify=False, random=False, logprobs=False, skips=False),
            SamplerVariant(modify=False, random=False, logprobs=True, skips=False),
            SamplerVariant(modify=False, random=True, logprobs=False, skips=False),
            SamplerVariant(modify=True, random=True, logprobs=True, skips=False),
        )


_PARTS = ("modify", "random", "logprobs")
ALL = SamplerVariant()  # everything, skipped at run time where no row needs it


def _when(variant: SamplerVariant, pred: jax.Array, fn, otherwise, *operands):
    """`fn(*operands)` where the batch-wide `pred` holds, else `otherwise(*operands)`: under
    `lax.cond` in a variant that skips, else `fn` alone, whose result must then equal
    `otherwise`'s on every row that does not need it (the callers mask by row)."""
    if variant.skips:
        return jax.lax.cond(pred, fn, otherwise, *operands)
    return fn(*operands)


def _uniforms(s: SamplingInputs) -> jax.Array:
    """f32[R] in [0, 1): one per row, from the request's seed and its sampled-token count."""

    def draw(seed, counter):
        k = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.uniform(jax.random.fold_in(k, counter), ())

    return jax.vmap(draw)(s.seeds, s.counters)


def _bisect(ok, lo: jax.Array, hi: jax.Array, *, unroll: bool = False) -> jax.Array:
    """Per row, the largest threshold t in [lo, hi] with ok(t) true, to ~(hi - lo) / 2**32.
    `ok` must be monotone (true up to some point, false after) and true at lo. `unroll`: no
    `while` in the program (a GPU's, see `SamplerVariant.skips`)."""

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi), unroll=unroll)
    return jnp.where(ok(hi), hi, lo)


def _filter(x: jax.Array, s: SamplingInputs, variant: SamplerVariant = ALL) -> jax.Array:
    """Masks (to -inf) tokens outside min-p, then top-k, then top-p. x: f32[R, V] scaled logits.

    The full-vocabulary definition (`_candidate_cut` is the fast one): each cut-off is a per-row
    threshold. Min-p keeps the tokens whose probability is at least min_p times the top one's;
    top-k keeps the values >= the k-th largest of those; top-p keeps the smallest set of most
    likely tokens whose mass, renormalised to what is left, reaches top_p. Tokens tied with a
    cut-off stay in."""
    vocab = x.shape[-1]
    top = x.max(axis=-1, keepdims=True)
    mth = top + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None]
    x = jnp.where((s.min_p[:, None] > 0) & (x < mth), -jnp.inf, x)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)[:, None]

    def kth_value():
        # From the least finite value: blocked ids (min_tokens) and min-p's cut are -inf, and
        # a bisection from -inf never leaves it (top-k was silently off while min_tokens held).
        least = jnp.where(x > -jnp.inf, x, top).min(axis=-1, keepdims=True)
        ok = lambda v: (x >= v).sum(axis=-1, keepdims=True) >= k  # noqa: E731
        return _bisect(ok, least, top, unroll=not variant.skips)

    # Each bisection is 32 passes over [R, V]: where the variant skips, it runs only when some
    # row has that cut-off (plain temperature sampling has neither).
    kth = _when(variant, jnp.any(s.top_k > 0), kth_value, lambda: top)
    x = jnp.where((s.top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    top_p = s.top_p[:, None]

    def top_p_cut(x):
        probs = jax.nn.softmax(x, axis=-1)
        pth = _bisect(
            lambda t: jnp.where(probs >= t, probs, 0.0).sum(axis=-1, keepdims=True) >= top_p,
            jnp.zeros_like(top),
            probs.max(axis=-1, keepdims=True),
            unroll=not variant.skips,
        )
        return jnp.where((top_p < 1.0) & (probs < pth), -jnp.inf, x)

    return _when(variant, jnp.any(top_p < 1.0), top_p_cut, lambda x: x, x)


class _Kept(NamedTuple):
    """What a row keeps of its candidates (sorted, descending) after the cut-offs so far: those
    of value at least `floor`. Every cut-off keeps a value and all above it, so their
    composition is one threshold, the largest of theirs; each narrows it with `_cut`."""

    floor: jax.Array  # f32[R]  the least value kept (-inf: every candidate)
    inside: jax.Array  # bool[R]  nothing past the candidates is kept: the row is covered
    whole: jax.Array  # bool[R]  the set kept over the whole vocabulary is x >= floor


def _cut(kept: _Kept, on: jax.Array, at: jax.Array, exact, outside: jax.Array) -> _Kept:
    """`kept` narrowed, on the rows where `on`, to the values >= `at` (a cut-off's threshold:
    ties with it stay in). `exact`: where `at` is the cut-off's threshold over the whole
    vocabulary. Elsewhere it is left undone on the candidates, and the set kept over the
    vocabulary is no longer known; so where a row is already `inside`, a cut-off must be
    exact or keep every candidate kept (a top-k past them, a top-p the kept mass never
    reaches). `outside`: f32[R], the largest value past the candidates (-inf if none)."""
    hit = on & exact
    return _Kept(
        floor=jnp.where(hit, jnp.maximum(kept.floor, at), kept.floor),
        inside=kept.inside | (hit & (outside < at)),
        whole=kept.whole & (exact | ~on),
    )


def _candidate_cut(x: jax.Array, s: SamplingInputs):
    """The min-p, top-k and top-p cut-offs along each row's sorted candidates, one `_cut`
    each, in `_filter`'s order.

    x: f32[R, V] scaled logits. Returns (vals f32[R, W] sorted descending, ids i32[R, W], keep
    bool[R, W], covered bool[R]), W = NUM_CANDIDATES + 1 (or V if smaller): where `covered`,
    `keep` is exactly the row's kept set (as `_filter` defines it), no token outside `ids` being
    kept. Only the first NUM_CANDIDATES columns can be kept: the last one is there for its
    value, which bounds every token outside the candidates.

    The top_k result is only ever read whole (reductions, gathers, masks), never sliced in two:
    XLA's CPU backend runs a top-k as its fast TopK call only when the sort it stands for has
    a single slice as its user; `vals[:, c]` beside `vals[:, :c]` made it sort all of V (10 ms
    for one row of V = 49152, 500 ms for 64, instead of 0.1 and 8)."""
    num_reqs, vocab = x.shape
    c = min(NUM_CANDIDATES, vocab)
    vals, ids = jax.lax.top_k(x, min(c + 1, vocab))
    pos = jnp.arange(vals.shape[-1])[None, :]
    candidate = pos < c
    outside = jnp.min(vals, axis=-1) if vocab > c else jnp.full((num_reqs,), -jnp.inf)
    kept = _Kept(
        floor=jnp.full((num_reqs,), -jnp.inf),
        inside=jnp.full((num_reqs,), vocab <= c),  # a small vocabulary is all candidates
        whole=jnp.ones((num_reqs,), jnp.bool_),
    )
    # Min-p: probability at least min_p times the top one's (the top one is a candidate).
    mth = vals.max(axis=-1) + jnp.log(jnp.maximum(s.min_p, 1e-30))
    kept = _cut(kept, s.min_p > 0, mth, True, outside)
    # Top-k: the values >= the k-th largest of what min-p kept, the larger of the k-th
    # candidate and min-p's threshold; past the candidates (k > C) it keeps every candidate.
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)  # [R]
    kth = jnp.take_along_axis(vals, jnp.clip(k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
    kept = _cut(kept, k < vocab, kth, k <= c, outside)
    # Top-p on the distribution renormalised to what min-p and top-k kept: the smallest prefix
    # of the sorted list reaching top_p, ties with its last token included. Its normaliser is
    # the kept candidates' where nothing else is kept, else that of x >= floor over all V
    # where that is the kept set; the cut is exact where the prefix ends among the candidates.
    pre = candidate & (vals >= kept.floor[:, None])
    log_norm = jnp.where(
        kept.inside,
        jax.nn.logsumexp(jnp.where(pre, vals, -jnp.inf), axis=-1),
        jax.nn.logsumexp(jnp.where(x >= kept.floor[:, None], x, -jnp.inf), axis=-1),
    )
    probs = jnp.where(pre, jnp.exp(vals - log_norm[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    last = jnp.max(jnp.where(pre & ((cum - probs) < s.top_p[:, None]), pos, 0), axis=-1)
    v_last = jnp.take_along_axis(vals, last[:, None], axis=-1)[:, 0]
    reached = (kept.inside | kept.whole) & (cum.max(axis=-1) >= s.top_p)
    kept = _cut(kept, s.top_p < 1.0, v_last, reached, outside)
    keep = candidate & (vals >= kept.floor[:, None])
    return vals, ids, keep, kept.inside


def _draw_candidates(vals, ids, keep, u):
    """The token whose cumulative probability over the kept candidates first exceeds u."""
    p = jnp.where(keep, jnp.exp(vals - vals.max(axis=-1, keepdims=True)), 0.0)
    cdf = jnp.cumsum(p, axis=-1)
    i = jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=-1)
    i = jnp.minimum(i, vals.shape[-1] - 1)
    return jnp.take_along_axis(ids, i[:, None], axis=-1)[:, 0]


def _draw_full(x: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse CDF over the whole vocabulary of softmax(x) (-inf = excluded), in two levels so
    no cumulative sum runs over V: which block of _CDF_BLOCK tokens, then which token in it."""
    num_reqs, vocab = x.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    p = jnp.exp(x - x.max(axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, num_blocks * _CDF_BLOCK - vocab))).reshape(
        num_reqs, num_blocks, _CDF_BLOCK
    )
    block_cdf = jnp.cumsum(p.sum(axis=-1), axis=-1)  # [R, blocks]
    target = u * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), num_blocks - 1)
    below = jnp.where(b > 0, jnp.take_along_axis(block_cdf, (b - 1)[:, None], -1)[:, 0], 0.0)
    cdf = below[:, None] + jnp.cumsum(jnp.take_along_axis(p, b[:, None, None], 1)[:, 0], -1)
    i = jnp.sum(cdf < target[:, None], axis=-1)
    # Rounding can leave the target past the block's last kept token: take that token.
    last = jnp.max(jnp.where(jnp.take_along_axis(p, b[:, None, None], 1)[:, 0] > 0,
                             jnp.arange(_CDF_BLOCK), 0), axis=-1)  # fmt: skip
    return (b * _CDF_BLOCK + jnp.minimum(i, last)).astype(jnp.int32)


def _random_draw(logits: jax.Array, s: SamplingInputs, variant: SamplerVariant) -> jax.Array:
    """Sampled token ids i32[R] of the random rows (greedy rows: whatever, the caller picks)."""
    random = s.temperature >= SAMPLING_EPS
    x = logits / jnp.where(random, s.temperature, 1.0)[:, None]
    u = _uniforms(s)

    def candidates():
        vals, ids, keep, covered = _candidate_cut(x, s)
        return _draw_candidates(vals, ids, keep, u).astype(jnp.int32), covered

    # A row without top-k, top-p or min-p takes the full path, so a batch of such rows skips
    # the top_k (its candidates cover it only in a vocabulary of at most NUM_CANDIDATES, and
    # they run only beside a row with a cut-off: its draw would depend on the batch).
    cut = (s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0)
    num_reqs = x.shape[0]
    drawn, covered = _when(
        variant,
        jnp.any(random & cut),
        candidates,
        lambda: (jnp.zeros((num_reqs,), jnp.int32), jnp.zeros((num_reqs,), jnp.bool_)),
    )
    uncovered = random & ~(covered & cut)
    # Only the uncovered rows' cut-offs matter on the full path: the others' are turned off,
    # so a batch whose uncovered rows sample at plain temperature skips the bisections.
    full_s = dataclasses.replace(
        s, top_k=jnp.where(uncovered, s.top_k, 0), top_p=jnp.where(uncovered, s.top_p, 1.0)
    )
    full = _when(
        variant,
        jnp.any(uncovered),
        lambda: _draw_full(_filter(x, full_s, variant), u),
        lambda: jnp.zeros_like(drawn),
    )
    return jnp.where(uncovered, full, drawn).astype(jnp.int32)


def _apply_penalties(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """vLLM's penalties on f32[R, V] logits. Repetition: a token seen in the prompt or the
    output has its logit divided by the penalty if positive, else multiplied. Frequency: minus
    the penalty times the token's count in the output. Presence: minus the penalty if the
    token occurs in the output."""
    num_reqs, seq_len = s.history_ids.shape
    rows = jnp.arange(num_reqs)[:, None]
    is_output = jnp.arange(seq_len)[None, :] >= s.num_prompt_tokens[:, None]  # [R, S]
    shape = logits.shape
    seen = jnp.zeros(shape, jnp.bool_).at[rows, s.history_ids].set(True, mode="drop")
    counts = (
        jnp.zeros(shape, jnp.int32)
        .at[rows, s.history_ids]
        .add(is_output.astype(jnp.int32), mode="drop")
    )
    rep = jnp.where(seen, s.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def _any_penalty(s: SamplingInputs) -> jax.Array:
    """Whether some row of the batch has a presence, frequency or repetition penalty."""
    return jnp.any(
        (s.presence_penalty != 0) | (s.frequency_penalty != 0) | (s.repetition_penalty != 1)
    )


def _apply_bitmask(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """-inf for each token the row's bitmask does not allow."""
    num_reqs, vocab = logits.shape
    bits = (s.token_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(num_reqs, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _modify(
    logits: jax.Array, s: SamplingInputs, constrained: jax.Array, variant: SamplerVariant
) -> jax.Array:
    """The bitmask (if some row is `constrained`), blocked ids, logit bias, then penalties
    (if some row has one)."""
    same = lambda x, _: x  # noqa: E731
    logits = _when(variant, constrained, _apply_bitmask, same, logits, s)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, s.blocked_ids].set(-jnp.inf, mode="drop")
    logits = logits.at[rows, s.logit_bias_ids].add(s.logit_bias, mode="drop")
    return _when(variant, _any_penalty(s), _apply_penalties, same, logits, s)


def token_logprobs(raw: jax.Array, ids: jax.Array):
    """Per row of raw logits [R, V]: the logprob of `ids[r]`, its rank (1 = most likely) and
    the top MAX_LOGPROBS ids and logprobs (padded with -inf past a smaller vocabulary)."""
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    rank = (logprobs > chosen[:, None]).sum(axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, raw.shape[-1]))
    pad = ((0, 0), (0, MAX_LOGPROBS - top_lp.shape[-1]))  # a vocabulary smaller than that
    top_lp = jnp.pad(top_lp, pad, constant_values=-jnp.inf)
    return chosen, rank, jnp.pad(top_ids, pad).astype(jnp.int32), top_lp


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (first index of the maximum) in one pass over [R, V] that
    makes nothing of its size: the vocabulary viewed as [R, V / B, B] blocks (B a divisor of V
    near sqrt(V): a reshape, not a copy), each block's maximum, the first block that holds the
    row's maximum, then the first index of it in that block alone ([R, B], gathered).

    XLA's CPU backend compiles both jnp.argmax (a variadic reduce) and the two-reduction form
    (max, then the least index where x equals it) into [R, V]-sized temporaries: the broadcast
    maximum, an index array, reduce-windows over it. Measured on a 2-core CPU beside a [R, 64]
    x [64, 49152] head: the two-reduction form 80 ms at R = 64, jnp.argmax 49 ms, this 2.5 ms
    (`benchmarks/sampler_step.py`). A row of NaNs gives id 0, in range."""
    rows, vocab = x.shape
    block = _argmax_block(vocab)
    blocks = -(-vocab // block)
    if blocks * block != vocab:  # no divisor fits: pad (a copy, for unusual vocabularies only)
        x = jnp.pad(x, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf)
    xb = x.reshape(rows, blocks, block)
    block_max = xb.max(axis=-1)
    top = block_max.max(axis=-1, keepdims=True)
    first_block = jnp.argmax(block_max == top, axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(xb, first_block[:, None, None], axis=1)[:, 0]
    index = first_block * block + jnp.argmax(inside == top, axis=-1).astype(jnp.int32)
    return jnp.minimum(index, vocab - 1)


def _argmax_block(vocab: int) -> int:
    """The block width of `argmax`: the divisor of `vocab` nearest sqrt(vocab) (on a log scale)
    when it leaves blocks of 16 or more and as many blocks, else 256 (with padding)."""
    divisors = [d for d in range(16, vocab // 16 + 1) if vocab % d == 0]
    if not divisors:
        return min(256, vocab)
    return min(divisors, key=lambda d: abs(math.log(d) - 0.5 * math.log(vocab)))


def sample(
    logits: jax.Array, s: SamplingInputs, variant: SamplerVariant = ALL
) -> SamplerOutput:  # logits: f32[R, V]
    """The tokens of the batch's rows, and their logprobs where asked for, with the parts
    `variant` holds (it must cover what the batch needs: `SamplingInputsBuilder.needs`)."""
    vocab = logits.shape[-1]
    raw = logits
    if variant.modify:
        constrained = jnp.any(s.token_bitmask != -1)
        modified = jnp.any(s.blocked_ids < vocab) | jnp.any(s.logit_bias_ids < vocab)
        modified |= _any_penalty(s) | constrained
        logits = _when(
            variant,
            modified,
            lambda x: _modify(x, s, constrained, variant),
            lambda x: x,
            logits,
        )
    greedy = argmax(logits)
    sampled = greedy
    if variant.random:
        random = s.temperature >= SAMPLING_EPS
        sampled = _when(
            variant,
            jnp.any(random),
            lambda: jnp.where(random, _random_draw(logits, s, variant), greedy),
            lambda: greedy,
        )
    num_reqs = logits.shape[0]
    none = (
        jnp.zeros((num_reqs,), jnp.float32),
        jnp.ones((num_reqs,), jnp.int32),
        jnp.zeros((num_reqs, MAX_LOGPROBS), jnp.int32),
        jnp.zeros((num_reqs, MAX_LOGPROBS), jnp.float32),
    )
    chosen, rank, top_ids, top_lp = none
    if variant.logprobs:  # computed on rows that did not ask, without skips: nobody reads them
        chosen, rank, top_ids, top_lp = _when(
            variant, jnp.any(s.logprobs), lambda: token_logprobs(raw, sampled), lambda: none
        )
    return SamplerOutput(sampled, chosen, rank, top_ids, top_lp)
