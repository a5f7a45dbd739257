"""`jaxllm convert`: any checkpoint the loaders read, saved as an orbax checkpoint (see
`jaxllm.loaders.orbax`)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm.loaders import load_model
from jaxllm.loaders.orbax import save, source_hf_config
from jaxllm.model_files import resolve_model


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, dtype=jnp.float32) -> Path:
    """Loads a Hugging Face directory, a GGUF file or a converted checkpoint in `dtype`
    (quantized weights dequantized), on the host CPU (host memory is usually larger than one
    accelerator's), and saves it as a converted checkpoint at `dst`."""
    path = resolve_model(src)
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} already exists and is not an empty directory")
    hf_config = source_hf_config(path)
    # Saved dequantized (GGUF, GPTQ, AWQ, compressed-tensors): the config says so no more.
    hf_config.pop("quantization_config", None)
    hf_config.pop("compression_config", None)
    with jax.default_device(jax.devices("cpu")[0]):
        loaded = load_model(path, dtype=dtype, load_tokenizer=True, quantization="float")
        return save(
            loaded,
            hf_config,
            loaded.tokenizer,
            loaded.generation_config,
            dst,
            source=str(path.resolve()),
        )
