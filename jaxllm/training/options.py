"""`jaxllm train-draft`'s settings (importing nothing heavy: the command line reads them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    num_speculative_tokens: int = 3  # k: drafts per verification (the test steps trained)
    epochs: int = 4
    learning_rate: float = 1e-3
    tokens_per_batch: int = 4096
    max_tokens: int = 256  # each answer's length
    draft_vocab_size: int = 4096
    held_out: int = 16  # prompts kept for the acceptance figure (without held_out_prompts)
    held_out_prompts: str | None = None  # a file of prompts to measure on instead
    seed: int = 0  # of the split, the batches' order and the head's new weights
    resume: bool = False
