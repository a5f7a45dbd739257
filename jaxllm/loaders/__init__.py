"""One entry point, `load_model`, for every source: a Hugging Face checkpoint directory, a
GGUF file, a checkpoint converted to orbax (`jaxllm convert`, see `loaders/convert.py` and `loaders/orbax.py`), or a
demo short name (resolved to its GGUF file)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import QUANTIZATIONS, REFERENCE_KERNELS, CompilationConfig, ModelConfig
from jaxllm.loaders import gguf as gguf_loader
from jaxllm.loaders import hf as hf_loader
from jaxllm.loaders import orbax as orbax_loader
from jaxllm.loaders import quantized_hf
from jaxllm.loaders.dummy import LOAD_FORMATS, dummy_state
from jaxllm.loaders.loaded import LoadedModel
from jaxllm.loaders.weights import build_state, rope_pairs_as_halves
from jaxllm.model_files import cache_dir, resolve_model
from jaxllm.models import get_model_class
from jaxllm.sharding import param_shardings, shard_config
from pallas_kernels import quant_matmul_cpu

logger = logging.getLogger(__name__)


def load_config(path: Path) -> ModelConfig:
    if path.is_dir():
        return hf_loader.load_hf_config(path)
    if path.suffix == ".gguf":
        return gguf_loader.load_gguf_config(path)
    raise ValueError(
        f"model path {path} is neither a Hugging Face checkpoint directory nor a .gguf file"
    )


def abstract_model(
    config: ModelConfig, dtype, compilation: CompilationConfig, mesh
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """The model of `config` as shapes only (the weights come from a checkpoint, or stay
    abstract for `jaxllm compile`): its config as sharded over `mesh` (kv heads repeated),
    its graph and its abstract state."""
    if mesh is not None:
        config = shard_config(config, mesh.shape["model"])
    cls = get_model_class(config)
    abstract = nnx.eval_shape(
        lambda: cls(config, dtype=dtype, compilation=compilation, mesh=mesh, rngs=None)
    )
    graphdef, abstract_state = nnx.split(abstract)
    return config, graphdef, abstract_state


def load_tokenizer(model: str | os.PathLike) -> tuple[Any, dict]:
    """The tokenizer (with its chat template) and generation config of a model, without its
    weights: what a front end process needs."""
    path = resolve_model(model)
    if path.is_dir():
        return hf_loader.load_hf_tokenizer(path), hf_loader.load_generation_config(path)
    if path.suffix == ".gguf":
        return gguf_loader.load_gguf_tokenizer(path, cache_dir()), {}
    load_config(path)  # raises the error that names what the path should be
    raise AssertionError


def gguf_kept_quantized() -> bool:
    """Whether a GGUF file's quantized tensors stay quantized when no quantization is asked
    for: on accelerators, and on CPUs where the native kernel has its integer path (8-bit dot
    products, or AVX2). With 8-bit dot products the demo model decodes at 2.8-2.9x the speed
    of its float32 dequantization at batch 1 and serves 2.1-2.2x and 2.6-2.7x llama.cpp's
    server at 8 and 32 clients (benchmarks/results/README.md), in 0.18x the bytes; with AVX2
    alone at 1.7x (batch 1) and 2.1x (batch 8). Elsewhere the kernel's float path would
    dequantize every weight on every step, so the weights are dequantized once
    (`quantization="float"`); `quantization="gguf"` keeps them quantized anyway."""
    if jax.default_backend() != "cpu":
        return True
    return quant_matmul_cpu.available() and quant_matmul_cpu.path() != "float"


def mxfp4_kept(quantization: str | None, *, on_cpu: bool | None = None) -> bool:
    """Whether an MXFP4 checkpoint's experts stay 4-bit on the device (dequantized inside the
    step): on accelerators, where they take a quarter of bfloat16's bytes (gpt-oss-120b's
    experts 57 GiB rather than 214), and anywhere with `quantization="mxfp4"`. On the CPU by
    default, and with `quantization="float"`, they are dequantized once at load: XLA's CPU
    backend would dequantize every expert on every step, and no native kernel reads E2M1.
    `on_cpu`: whether the model runs on the CPU (default: JAX's backend; `jaxllm compile`
    says False for its targets)."""
    if quantization in ("mxfp4", "float"):
        return quantization == "mxfp4"
    if on_cpu is None:
        on_cpu = jax.default_backend() == "cpu"
    return not on_cpu  # None, or int8 / int4 / fp8 for the other layers


def fp8_experts_kept(quantization: str | None, *, on_cpu: bool | None = None) -> bool:
    """Whether a fine-grained FP8 checkpoint's experts stay 8-bit on the device (dequantized
    inside the step, `quantization.FP8Experts`): on accelerators, where they take half of
    bfloat16's bytes (DeepSeek-V3's 656 GB rather than 1.3 TB), and anywhere with
    `quantization="fp8"`. On the CPU by default they are dequantized once at load, as MXFP4
    experts are (`mxfp4_kept`); with any other `quantization` always."""
    if quantization is not None:
        return quantization == "fp8"
    if on_cpu is None:
        on_cpu = jax.default_backend() == "cpu"
    return not on_cpu


def hf_tensors(
    path: Path,
    hf_config: dict,
    method: str | None,
    quantization: str | None,
    names: set[str] | None = None,
):
    """A checkpoint directory's (name, tensor) pairs (with `names`, only those), a quantized
    checkpoint's (`method`) modules each grouped into one tensor as `quantization` keeps them
    (`quantized_hf.group_quantized`)."""
    tensors = hf_loader.iter_safetensors(path, names)
    if method is None:
        return tensors
    qc = hf_config.get("quantization_config") or hf_config["compression_config"]
    return quantized_hf.group_quantized(tensors, method, qc, keep_mxfp4=mxfp4_kept(quantization))


def load_model(
    model: str | os.PathLike,
    *,
    dtype: jnp.dtype = jnp.float32,
    compilation: CompilationConfig = REFERENCE_KERNELS,
    load_tokenizer: bool = True,
    mesh: Mesh | None = None,
    quantization: str | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """With a `mesh`, the model is built for tensor parallelism over its "model" axis (see
    `jaxllm.sharding`) and each device receives only its shard of each parameter. A converted
    orbax checkpoint (a directory with a `jaxllm_orbax.json` marker) is restored straight
    into that layout, each device reading its own shard. `quantization`: see
    `jaxllm.quantization` (None: as the checkpoint is stored; a GGUF file's tensors are
    dequantized on the CPU, kept quantized on accelerators). `compilation`: the kernel
    choices the model is traced with (resolved: see `DecoderForCausalLM`). `load_format`
    "dummy" makes random weights in the model's shapes instead of reading any (see
    `loaders/dummy.py`): a checkpoint directory needs only its `config.json`."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    path = resolve_model(model)
    method = None  # the checkpoint's own quantization
    if path.suffix == ".gguf":
        method = "gguf"
    elif (path / "config.json").is_file():
        hf_config = json.loads((path / "config.json").read_text())
        method = quantized_hf.checkpoint_method(hf_config)
    keep_fp8_experts = method == "fp8" and fp8_experts_kept(quantization)
    if method == "gguf" and quantization == "mxfp4":
        if not gguf_loader.has_mxfp4(path):
            raise ValueError(f"quantization mxfp4: {path} has no MXFP4 tensors")
    elif method == "fp8" and quantization == "fp8":
        quantization = None  # vLLM's spelling for an fp8 checkpoint: kept as it is
    elif quantization in ("gguf", *quantized_hf.METHODS) and quantization not in (method, "fp8"):
        raise ValueError(
            f"quantization {quantization} does not match the checkpoint {path} "
            f"({method or 'not quantized'})"
        )
    if load_format == "dummy" and quantization not in (None, "float"):
        raise ValueError(
            f"quantization {quantization} cannot be used with load_format dummy: random "
            "weights are made in the model's float dtype"
        )
    if quantization is None and method == "gguf" and not gguf_kept_quantized():
        quantization = "float"
    start = time.perf_counter()
    config, graphdef, abstract_state = abstract_model(load_config(path), dtype, compilation, mesh)
    shardings = None if mesh is None else param_shardings(abstract_state, mesh)
    if load_format == "dummy":
        state = dummy_state(abstract_state, dtype, shardings)
        generation_config = hf_loader.load_generation_config(path) if path.is_dir() else {}
    elif orbax_loader.is_orbax_checkpoint(path):
        if quantization not in (None, "float"):
            raise ValueError(
                f"quantization {quantization} is not supported for orbax checkpoints; load the "
                "original checkpoint (HF directory or GGUF file) with it instead"
            )
        state = orbax_loader.restore_state(path, abstract_state, config, dtype, shardings)
        generation_config = hf_loader.load_generation_config(path)
    else:
        if path.is_dir():
            tensors = hf_tensors(path, hf_config, method, quantization)
            generation_config = hf_loader.load_generation_config(path)
        else:
            keep = mxfp4_kept(quantization)
            tensors = gguf_loader.iter_gguf(path, keep_quantized=True, keep_mxfp4=keep)
            generation_config = {}
        if config.rope_interleaved:  # (llama.cpp's converter leaves Llama 4's pairs so too)
            tensors = rope_pairs_as_halves(tensors, config)
        state = build_state(
            abstract_state,
            tensors,
            config,
            dtype,
            shardings,
            quantization,
            keep_fp8_experts=keep_fp8_experts,
        )
    tokenizer = None
    if load_tokenizer:
        if path.is_dir():
            tokenizer = hf_loader.load_hf_tokenizer(path)
        else:
            tokenizer = gguf_loader.load_gguf_tokenizer(path, cache_dir())
    logger.info(
        "loaded %s (%s) in %.1f s", path.name, config.architecture, time.perf_counter() - start
    )
    return LoadedModel(config, nnx.merge(graphdef, state), tokenizer, generation_config, path)


__all__ = ["LoadedModel", "load_config", "load_model", "load_tokenizer"]
