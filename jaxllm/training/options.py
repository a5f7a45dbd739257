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

    def __post_init__(self) -> None:
        for name, low in (
            ("num_speculative_tokens", 1),
            ("epochs", 1),
            ("tokens_per_batch", 64),
            ("max_tokens", 1),
            ("draft_vocab_size", 1),
            ("held_out", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(
                f"--num-speculative-tokens must be at most 16, got {self.num_speculative_tokens}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"--learning-rate must be > 0, got {self.learning_rate!r}")
