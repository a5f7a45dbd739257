"""`PoolingParams`: what a pooling request (an embedding) asks beyond its prompt, with vLLM's
names."""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """`normalize`: L2-normalize the vector (None: as the checkpoint says, see
    `jaxllm.pooling.read_pooler_config`). `dimensions`: keep the first this many values
    (Matryoshka embeddings), before normalizing as sentence-transformers does.
    `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: the last
    max_model_len); None refuses a prompt longer than max_model_len. `activation`: a
    classifier's outputs are its labels' probabilities (sigmoid or softmax); False: the raw
    logits."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None

    def check(self, hidden_size: int) -> None:
        """Raises a ValueError naming the field for a value no request may carry."""
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise ValueError(
                f"dimensions must be between 1 and the model's {hidden_size}, got {self.dimensions}"
            )
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {k}")
