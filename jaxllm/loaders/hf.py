"""Loading a Hugging Face checkpoint directory: config.json, *.safetensors (one file or a
sharded index), tokenizer files and chat template, generation_config.json."""

from __future__ import annotations

import json
import struct
from collections.abc import Container, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxllm.config import ModelConfig
from jaxllm.models.bert import ENCODER_ARCHITECTURES


def checkpoint_architectures(path: str | Path) -> list[str] | None:
    """The `architectures` a Hugging Face checkpoint directory's config.json names, or None
    where `path` is no such directory (a GGUF file, say)."""
    config = Path(path) / "config.json"
    if not Path(path).is_dir() or not config.is_file():
        return None
    return json.loads(config.read_text()).get("architectures") or []


def load_hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    config = json.loads(config_file.read_text())
    encoder = [a for a in config.get("architectures") or [] if a in ENCODER_ARCHITECTURES]
    if encoder:
        raise ValueError(
            f"{path}: {encoder[0]} is an encoder (a pooling model: embeddings), which the "
            "generative engine does not run; LLM(model).embed(...) and `jaxllm serve` "
            "(/v1/embeddings) do"
        )
    return ModelConfig.from_hf_config(config)


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


# Dtypes safetensors' numpy reader does not know (it looks them up on numpy itself), read
# here from the file's own header: fp8 weights of compressed-tensors checkpoints.
_RAW_DTYPES = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # power-of-two scales (UE8M0)
}


def _raw_tensors(f: Path) -> dict[str, np.ndarray]:
    """{name: array} for the tensors of `_RAW_DTYPES` in safetensors file `f` (memory-mapped)."""
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    data = np.memmap(f, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] in _RAW_DTYPES:
            start, end = info["data_offsets"]
            dtype = _RAW_DTYPES[info["dtype"]]
            out[name] = data[start:end].view(dtype).reshape(info["shape"])
    return out


def iter_safetensors(
    path: Path, names: Container[str] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor) pairs, read lazily from the memory-mapped files; with `names`, only
    those tensors are read."""
    for f in safetensors_files(path):
        raw = None
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if names is not None and name not in names:
                    continue
                try:
                    tensor = st.get_tensor(name)
                except AttributeError:  # a dtype numpy lacks
                    raw = _raw_tensors(f) if raw is None else raw
                    if name not in raw:
                        raise
                    tensor = raw[name]
                yield name, tensor


# A checkpoint directory has a tokenizer if it has one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_tokenizer(path: Path):
    """The directory's tokenizer, or None where it has none (a `config.json` alone, as
    `--load-format dummy` and `jaxllm compile` take): requests then give token ids."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
