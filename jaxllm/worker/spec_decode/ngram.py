"""The n-gram proposer (vLLM's `ngram` method): drafts from the sequence itself."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxllm.worker.features import Feature
from jaxllm.worker.input_batch import InputBatch


class NgramProposer(Feature):
    """Prompt lookup (vLLM's `ngram` method): finds the latest earlier occurrence of the
    sequence's last n tokens, for n from `max_n` down to `min_n`, and proposes the (up to) k
    tokens that followed it."""

    def __init__(self, k: int, min_n: int, max_n: int, input_batch: InputBatch | None = None):
        """`input_batch`: the runner's persistent batch, whose rows `propose` reads."""
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.input_batch = input_batch

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
    ) -> None:
        return None

    def propose(self, launched: None, held: list[tuple[str, int, int]]) -> dict[str, list[int]]:
        ib = self.input_batch
        return {
            rid: self.propose_after(ib.token_ids[row, : ib.num_tokens[row]]) for rid, _, row in held
        }

    def propose_after(self, tokens: np.ndarray) -> list[int]:
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
