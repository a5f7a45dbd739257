"""The on-device sampler: per-request parameters arrive as arrays, so one compiled program
serves any mix of greedy and random requests.

Randomness is per request: request r's key is derived from its own seed and the number of
tokens it has sampled so far, so the same seed gives the same text whatever else shares the
batch. Logprobs are those of the model's raw distribution (before temperature and top-k/p),
as vLLM returns them by default.

Static variants (part of the compiled program's key): `all_greedy` skips the sort and the
random draw; `num_logprobs` > 0 adds the log-softmax and a top-k over the vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    temperature: jax.Array  # f32[R]  0 = greedy
    top_k: jax.Array  # i32[R]  0 = off
    top_p: jax.Array  # f32[R]  1 = off
    min_p: jax.Array  # f32[R]  0 = off
    seeds: jax.Array  # u32[R, 2]  the request's 64-bit seed, low and high words
    counters: jax.Array  # i32[R]  tokens the request has sampled so far


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    sampled: jax.Array  # i32[R]
    logprob: jax.Array  # f32[R]     the sampled token's logprob (0 when logprobs are off)
    rank: jax.Array  # i32[R]     its rank in the distribution, 1 = most likely
    top_ids: jax.Array  # i32[R, L]  top-L alternatives (L = num_logprobs, may be 0)
    top_logprobs: jax.Array  # f32[R, L]


def _request_keys(s: SamplingInputs) -> jax.Array:
    def key(seed, counter):
        k = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(k, counter)

    return jax.vmap(key)(s.seeds, s.counters)


def _filter(x: jax.Array, s: SamplingInputs) -> jax.Array:
    """Masks (to -inf) tokens outside top-k, top-p and min-p. x: f32[R, V] scaled logits."""
    vocab = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
    sorted_x = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_x, -jnp.inf)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p[:, None]
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    pth = jnp.take_along_axis(sorted_x, (num_keep - 1)[:, None], axis=-1)
    # min-p: a token stays if its probability is at least min_p times the top one's.
    mth = sorted_x[:, :1] + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None]
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(s.min_p[:, None] > 0, mth, -jnp.inf))
    return jnp.where(x < threshold, -jnp.inf, x)


def sample(
    logits: jax.Array,  # f32[R, V]
    s: SamplingInputs,
    *,
    all_greedy: bool,
    num_logprobs: int,
) -> SamplerOutput:
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        sampled = greedy
    else:
        temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)
        x = _filter(logits / temperature[:, None], s)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:]))(_request_keys(s))
        drawn = jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)
        sampled = jnp.where(s.temperature > 0, drawn, greedy)

    num_reqs = logits.shape[0]
    if num_logprobs == 0:
        zeros = jnp.zeros((num_reqs,), jnp.float32)
        return SamplerOutput(
            sampled,
            zeros,
            jnp.ones((num_reqs,), jnp.int32),
            jnp.zeros((num_reqs, 0), jnp.int32),
            jnp.zeros((num_reqs, 0), jnp.float32),
        )
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, sampled[:, None], axis=-1)[:, 0]
    rank = (logprobs > chosen[:, None]).sum(axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return SamplerOutput(sampled, chosen, rank, top_ids.astype(jnp.int32), top_lp)
