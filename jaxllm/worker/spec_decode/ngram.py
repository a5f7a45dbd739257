"""Speculative decoding: how a step verifies draft tokens (done on the device by
`runner._head_and_sample`), and the n-gram proposer (the draft model's is `draft_runner`).

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

import numpy as np


class NgramProposer:
    """Prompt lookup (vLLM's `ngram` method): finds the latest earlier occurrence of the
    sequence's last n tokens, for n from `max_n` down to `min_n`, and proposes the (up to) k
    tokens that followed it."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: np.ndarray) -> list[int]:
        """Draft tokens to follow `tokens` (a 1-D int array), or [] when no n-gram matches."""
        total = len(tokens)
        if total <= self.min_n:
            return []
        # Starts i of the earlier occurrences of the last min_n tokens, followed by at least
        # one token: i + min_n <= total - 1.
        suffix = tokens[total - self.min_n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], self.min_n)
        (starts,) = np.nonzero((windows == suffix).all(axis=1))
        if len(starts) == 0:
            return []
        # Extend each match backwards while it still equals the sequence's suffix, up to max_n.
        length = np.full(len(starts), self.min_n)
        for n in range(self.min_n + 1, min(self.max_n, total - 1) + 1):
            ok = (starts - (n - self.min_n) >= 0) & (length == n - 1)
            ok[ok] = tokens[starts[ok] - (n - self.min_n)] == tokens[total - n]
            length[ok] = n
        # The longest match, the latest among equals; what followed it.
        best = len(starts) - 1 - int(np.argmax(length[::-1]))
        follow = int(starts[best]) + self.min_n
        return tokens[follow : follow + self.k].tolist()
