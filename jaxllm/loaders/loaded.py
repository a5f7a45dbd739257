"""What a loader returns: a model with its weights, config and tokenizer (a leaf, so the
writers of checkpoints can take one without importing the loaders)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx

from jaxllm.config import ModelConfig


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: nnx.Module  # the Flax NNX model with its weights
    tokenizer: Any  # a transformers tokenizer (with its chat template), or None
    generation_config: dict  # generation_config.json, {} when absent
    path: Path
