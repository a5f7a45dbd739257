"""Speculative decoding: a proposer drafts k tokens per request, and the next step verifies
them (`verification`, on the device inside the head-and-sampler program).

A request that decodes with drafts d_1..d_k is granted 1 + k tokens: its last token and the
drafts, computed in one forward pass, whose logits give the target's distributions p_0..p_k
(p_j: the next token after d_j). The sampler draws a token y_j from every p_j with exactly the
randomness it would use for that token without speculation (the request's seed and the token's
index), and the step accepts the longest prefix of drafts with d_{j+1} == y_j; the request's new
tokens are the accepted drafts and one more, y_a at the first mismatch (or y_k, the bonus
token). So the output is token for token the output without speculation, greedy or random.

This is rejection sampling (Leviathan et al., Chen et al.) for a proposer that puts all its
probability on its draft (vLLM treats n-gram and its greedy draft models that way): it accepts
d with probability p(d), and after a rejection the token is distributed as p without d,
renormalised, which is the residual max(p - q, 0) for q one-hot on d. Drawing y ~ p and
comparing couples the two events with one draw.

The KV of rejected drafts is written and then overwritten: the scheduler rolls
`num_computed_tokens` back to the accepted tokens, so the next step writes those positions again.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import AttentionMetadata

# The proposers live in `ngram`, `draft_model` and `heads` (EAGLE-3, MTP), the verification in
# `verification`; this package's own module holds only what they share, so importing one
# imports no other.


class Proposer(Protocol):
    """How the runner asks for drafts. `launch` runs when a step is dispatched, with its
    inputs (the prepared step, its forward pass's buffer on the device and the earlier
    sampled tokens its placeholders read, as the forward pass read them), its sampled
    tokens and (for a head) the target's states it reads, still on the device (a
    draft model dispatches its own program there); `propose` runs when the step's output is
    back, for the requests that sampled and still hold their batch rows: `held` is (request
    id, index in the step's requests, batch row) each, and the result the drafts for each
    request's next step. A step that does not speculate (`SchedulerOutput.propose_drafts`,
    see `jaxllm.engine.spec_policy`) launches with `propose` False: a proposer with a cache
    then only writes the step's KV into it (its `fill` program, compiled where `fills`), and
    `propose` is not called. A proposer is also one of the runner's features
    (`jaxllm.worker.features.Feature`), for its programs."""

    def launch(
        self,
        step: Any,
        batch: Any,
        last_tokens: Any,
        rows: np.ndarray,
        sampled: Any,
        kept: Any,
        aux: Any = None,
        propose: bool = True,
    ) -> Any: ...

    def propose(self, launched: Any, held: list[tuple[str, int, int]]) -> dict[str, list[int]]: ...


# ---- on the device, inside a proposer's program ------------------------------------------------


def last_kept(kept: jax.Array, first_rows: jax.Array, num_rows: jax.Array) -> tuple:
    """Per request (its first logit row, its rows): (the rows the verification kept, its last
    kept logit row), from the step's bool[L] `kept`."""
    counts = jnp.cumsum(kept.astype(jnp.int32))
    before = counts[first_rows] - kept[first_rows].astype(jnp.int32)
    num_kept = counts[first_rows + num_rows - 1] - before
    return num_kept, jnp.maximum(first_rows + num_kept - 1, 0)


def one_token_metadata(
    positions: jax.Array,  # i32[R]: each request's drafting position
    writes: jax.Array,  # bool[R]: the rows that write their KV (that sampled, within slots)
    block_tables: jax.Array,  # i32[R, P]
    page_size: int,
    dropped_slot: int,
) -> tuple[jax.Array, AttentionMetadata]:
    """(the positions as read, the attention metadata) of a drafting step of one token per
    request. Past the block table's reach (drafts past max_model_len, cut by the scheduler) a
    row reads as if at its last position, writing nothing."""
    num_reqs = positions.shape[0]
    at = jnp.minimum(positions, block_tables.shape[1] * page_size - 1)
    page = block_tables[
        jnp.arange(num_reqs), jnp.minimum(at // page_size, block_tables.shape[1] - 1)
    ]
    slots = jnp.where(writes, page * page_size + at % page_size, dropped_slot)
    meta = AttentionMetadata(
        slot_mapping=slots[None],
        seq_lens=at + 1,
        block_tables=block_tables[None],
        cu_q_lens=jnp.arange(num_reqs + 1, dtype=jnp.int32),
        num_seqs=jnp.full((1,), num_reqs, jnp.int32),
    )
    return at, meta
