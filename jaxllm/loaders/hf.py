"""Loading a Hugging Face checkpoint directory: config.json, *.safetensors (one file or a
sharded index), tokenizer files and chat template, generation_config.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxllm.config import ModelConfig


def load_hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return ModelConfig.from_hf_config(json.loads(config_file.read_text()))


def load_generation_config(path: Path) -> dict:
    f = path / "generation_config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight file {f} named by the index is missing")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor) pairs, read lazily from the memory-mapped files."""
    for f in safetensors_files(path):
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, st.get_tensor(name)


def load_hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
