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

import numpy as np

# The proposers live in `ngram`, `draft_model` and `eagle3`, the verification in `verification`; this
# package's own module holds only what they share, so importing one imports no other.


class Proposer(Protocol):
    """How the runner asks for drafts. `launch` runs when a step is dispatched, with its
    inputs (the prepared step, and its forward pass's buffer on the device), its sampled
    tokens and (for an EAGLE-3 head) the target's aux hidden states, still on the device (a draft model dispatches its own program there); `propose`
    runs when the step's output is back, for the requests that sampled and still hold their
    batch rows: `held` is (request id, index in the step's requests, batch row) each, and the
    result the drafts for each request's next step. A proposer is also one of the runner's
    features (`jaxllm.worker.features.Feature`), for its programs."""

    def launch(
        self, step: Any, batch: Any, rows: np.ndarray, sampled: Any, kept: Any, aux: Any = None
    ) -> Any: ...

    def propose(self, launched: Any, held: list[tuple[str, int, int]]) -> dict[str, list[int]]: ...
