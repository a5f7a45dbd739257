"""The compiled shapes: every batch is padded to one of them, so the number of programs is
bounded and all of them compile at warmup.

The token count pads to a token bucket, the request count to a request bucket paired with it
(`make_buckets`); the block table has a fixed `pages_per_seq` width.
"""

from __future__ import annotations


def _ladder(stop: int, fine: bool = False) -> list[int]:
    """Bucket sizes 1, 4, 16, then doubling, below `stop`, then `stop`; with `fine`, doubling
    from 1.

    Steps of 4 at the small end: XLA's CPU matmuls take about as long for 2 to 16 rows as for
    16 (1.2-1.6 ms per layer of the demo model on a 2-core AMD EPYC, against 0.5-0.65 ms for
    one row), and on accelerators a weight-streaming matmul costs the same for any row count
    that small; so buckets of 2 and 8 would only add programs to compile. Past 16 the work
    grows with the rows, and doubling keeps padding under 2x. `fine` is for steps whose work
    grows with the rows from the first: quantized weights on the CPU, whose native kernel is
    bound by its arithmetic (8 rows padded to 16 made the demo GGUF's decode step 24 ms
    instead of about 12 in its matmuls)."""
    out, b = [], 1
    while b < stop:
        out.append(b)
        b = b * 4 if b < 16 and not fine else b * 2
    return [*out, stop]


# A token bucket t pairs with the request buckets r in [limit / _REQUEST_SPAN, limit], limit =
# min(t, max_num_seqs). Fewer requests than that in t tokens means a prefill chunk is in the
# batch, and its token work dwarfs what the padded request rows cost (the output head and the
# sampler run per request row: on the demo model on a 2-core CPU, 4 ms for one row, 11 ms for 8,
# 30 ms for 64, against ~700 ms for a 512-token step).
_REQUEST_SPAN = 4


def make_buckets(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_speculative_tokens: int = 0,
    *,
    fine: bool = False,
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """(token buckets, request buckets, compiled shapes): both bucket lists follow `_ladder` up
    to their maximum (`fine`: see there), so a one-request decode is a (1, 1) program (no
    16-token, 8-row floor);
    the shapes are the (token bucket, request bucket) pairs a batch can pad to, at most three
    request buckets per token bucket (see `_REQUEST_SPAN`). With speculative decoding of k
    tokens, r requests verifying k drafts each fill a token bucket of r * (1 + k)."""
    tokens, requests = _ladder(max_num_batched_tokens, fine), _ladder(max_num_seqs, fine)
    if num_speculative_tokens:
        spec = (r * (1 + num_speculative_tokens) for r in requests)
        tokens = sorted({*tokens, *(t for t in spec if t < max_num_batched_tokens)})
    shapes = []
    for t in tokens:
        limit = min(t, max_num_seqs)
        shapes += [(t, r) for r in requests if r <= limit and r * _REQUEST_SPAN >= limit]
    return tokens, requests, shapes


def logit_rows(shape: tuple[int, int], num_speculative_tokens: int) -> int:
    """Rows of hidden states a step of this shape samples from: one per request, and with
    speculative decoding one more per draft token (never more than its tokens)."""
    t, r = shape
    return min(t, r * (1 + num_speculative_tokens))


def pick_shape(num_tokens: int, num_reqs: int, shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest compiled shape that holds the batch: the least token bucket, then the least
    request bucket paired with it."""
    for t, r in shapes:  # ordered by token bucket, then request bucket
        if t >= num_tokens and r >= num_reqs:
            return t, r
    raise ValueError(f"no compiled shape holds {num_tokens} tokens of {num_reqs} requests")
