"""Loading a BERT-style encoder (`jaxllm.models.bert`) from a Hugging Face checkpoint
directory: config.json and *.safetensors, the tensors as Hugging Face names them (with or
without a task model's prefix), torch's `[out, in]` linear weights transposed."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.loaders.hf import checkpoint_architectures, iter_safetensors
from jaxllm.models.bert import ENCODER_ARCHITECTURES, BertEncoder, EncoderConfig


def is_encoder(path: str | Path) -> bool:
    """Whether the checkpoint directory at `path` holds an encoder (a pooling model)."""
    return any(a in ENCODER_ARCHITECTURES for a in checkpoint_architectures(path) or ())


# The prefixes task checkpoints (`BertForMaskedLM`, ...) put before the encoder's tensors.
_PREFIXES = ("bert.", "roberta.", "model.")

# Hugging Face tensor names (after the task prefix) -> this module's parameter paths; {i} a layer.
_NAMES = {
    "embeddings.word_embeddings.weight": "word_embeddings",
    "embeddings.position_embeddings.weight": "position_embeddings",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings",
    "embeddings.LayerNorm.weight": "embedding_norm.weight",
    "embeddings.LayerNorm.bias": "embedding_norm.bias",
}
_LAYER_NAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attention_output",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}


_DENSE = {"query", "key", "value", "attention_output", "intermediate", "output"}


def _target(name: str) -> str | None:
    """This module's parameter path for a checkpoint tensor, or None for one it does not use
    (the pooler, a task head, `position_ids` buffers)."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name in _NAMES:
        return _NAMES[name]
    if not name.startswith("encoder.layer."):
        return None
    index, rest = name[len("encoder.layer.") :].split(".", 1)
    module, _, leaf = rest.rpartition(".")
    if module not in _LAYER_NAMES or leaf not in ("weight", "bias"):
        return None
    return f"layers.{index}.{_LAYER_NAMES[module]}.{leaf}"


def load_encoder(path: str | Path, *, dtype=jnp.float32) -> BertEncoder:
    """The encoder of a Hugging Face checkpoint directory (config.json, *.safetensors)."""
    path = Path(path)
    config = EncoderConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = BertEncoder(config, dtype=dtype)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    loaded = set()
    for name, array in iter_safetensors(path):
        target = _target(name)
        if target is None:
            continue
        key = tuple(int(p) if p.isdigit() else p for p in target.split("."))
        if key not in params:
            raise ValueError(f"{path}: tensor {name} has no place in a {config.architecture}")
        want = params[key].get_value()
        if key[-1] == "weight" and key[-2] in _DENSE:
            array = array.T  # torch's Linear weight is [out, in]
        if array.shape != want.shape:
            raise ValueError(
                f"{path}: tensor {name} is {list(array.shape)}, expected {list(want.shape)}"
            )
        params[key].set_value(jnp.asarray(np.asarray(array), dtype))
        loaded.add(key)
    if missing := sorted(".".join(map(str, k)) for k in params.keys() - loaded):
        raise ValueError(f"{path}: the checkpoint lacks {', '.join(missing[:5])}")
    return model
