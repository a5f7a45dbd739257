"""Loading a checkpoint's multi-token-prediction layer (`jaxllm.models.mtp`) from the target's
own weights, as vLLM's `DeepSeekMTP` reads them: `model.layers.{L}.*` for L the target's
`num_hidden_layers` (the first MTP layer; later ones are not read, as vLLM's proposer repeats
the first). Its decoder block's tensors go through the target's own loader as a one-layer
model's (`layers.0.*`: the family's renaming, RoPE pairs, stacked experts, an FP8
checkpoint's scales, dequantized); `enorm`, `hnorm`, `eh_proj` and `shared_head.*` are read
here, `embed_tokens` where the checkpoint has a copy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxllm.config import REFERENCE_KERNELS, CompilationConfig, ModelConfig
from jaxllm.loaders import fp8_experts_kept, hf_tensors, quantized_hf
from jaxllm.loaders.hf import safetensors_files
from jaxllm.loaders.weights import build_state, rope_pairs_as_halves
from jaxllm.model_files import resolve_model
from jaxllm.models.mtp import MTPConfig, MTPHead
from jaxllm.quantization import QArray, SplitRows, dequantize_np
from jaxllm.sharding import param_shardings

# The layer's tensors outside its decoder block -> (our path, from torch's layout).
_OWN = {
    "enorm.weight": (("enorm", "weight"), lambda w: w),
    "hnorm.weight": (("hnorm", "weight"), lambda w: w),
    "eh_proj.weight": (("eh_proj",), lambda w: w.T),
    "shared_head.norm.weight": (("shared_head", "norm", "weight"), lambda w: w),
    "shared_head.head.weight": (("shared_head", "head"), lambda w: w.T),
}


def _layer_tensor_names(path: Path, index: int) -> set[str]:
    """The names of `model.layers.{index}`'s tensors, without that prefix."""
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return set()
    prefix = f"model.layers.{index}."
    names = set()
    for f in safetensors_files(path):
        with safe_open(f, framework="numpy") as st:
            names |= {n.removeprefix(prefix) for n in st.keys() if n.startswith(prefix)}  # noqa: SIM118
    return names


def _read_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(
            f"speculative_config: method mtp reads the layers of a Hugging Face checkpoint "
            f"directory, and {path} has no config.json"
        )
    return json.loads(config.read_text())


def load_mtp_config(path: Path, target: ModelConfig) -> MTPConfig:
    """The MTP layer's config for `target` from checkpoint `path`'s config.json alone (as
    `jaxllm compile` reads it: taken to have the layer's tensors)."""
    return MTPConfig.from_hf_config(_read_config(path), target, None)


def abstract_head(
    config: MTPConfig, dtype, compilation: CompilationConfig, mesh
) -> tuple[nnx.GraphDef, nnx.State]:
    """The head as shapes (its config's layer is the target's, sharded as the target is)."""
    abstract = nnx.eval_shape(
        lambda: MTPHead(config, dtype=dtype, compilation=compilation, mesh=mesh, rngs=None)
    )
    return nnx.split(abstract)


def load_mtp_head(
    model: str | os.PathLike,
    target: ModelConfig,
    *,
    dtype=jnp.float32,
    compilation: CompilationConfig = REFERENCE_KERNELS,
    mesh=None,
    quantization: str | None = None,
) -> tuple[MTPHead, MTPConfig]:
    """The MTP layer of checkpoint `model` for `target` (its config as loaded), its weights on
    the target's devices (replicated, or split over `mesh` as the target's are), its decoder
    block quantized as the target's layers are (`quantization`: the engine's; an FP8
    checkpoint's experts kept where the target's are)."""
    path = resolve_model(model)
    raw = _read_config(path)
    names = _layer_tensor_names(path, target.num_layers)
    config = MTPConfig.from_hf_config(raw, target, names)
    graphdef, abstract = abstract_head(config, dtype, compilation, mesh)
    shardings = None if mesh is None else param_shardings(abstract, mesh)
    expected = dict(nnx.to_flat_state(abstract))
    prefix = f"model.layers.{config.layer_index}."
    method = quantized_hf.checkpoint_method(raw)
    keep_fp8_experts = method == "fp8" and fp8_experts_kept(quantization)
    if method == "fp8" and quantization == "fp8":
        quantization = None  # (as `load_model`: the checkpoint's own fp8 kept)
    tensors = hf_tensors(path, raw, method, quantization, {prefix + n for n in names})
    filled: dict[tuple, jax.Array] = {}
    block: list[tuple[str, np.ndarray]] = []
    for name, w in tensors:
        name = name.removeprefix(prefix)
        if name in _OWN:
            key, layout = _OWN[name]
            w = dequantize_np(w) if isinstance(w, QArray | SplitRows) else np.asarray(w)
            value = jnp.asarray(layout(w), expected[key].get_value().dtype)
            if value.shape != expected[key].shape:
                raise ValueError(
                    f"speculative_config: the MTP layer's {prefix}{name} is {list(w.shape)}, "
                    f"the target's config makes it {list(expected[key].shape)} (transposed)"
                )
            filled[key] = value if shardings is None else jax.device_put(value, shardings[key])
        elif name == "embed_tokens.weight":
            block.append(("model.embed_tokens.weight", w))
        else:  # the decoder block: the target's loader, as layer 0 of a one-layer model
            block.append((f"model.layers.0.{name}", w))
    if config.layer.rope_interleaved:
        block = list(rope_pairs_as_halves(block, config.layer))
    inner = nnx.from_flat_state([(p, v) for p, v in expected.items() if p not in _OWN_PATHS])
    try:
        state = build_state(
            inner, block, config.layer, dtype, shardings, quantization,
            keep_fp8_experts=keep_fp8_experts,
        )  # fmt: skip
    except ValueError as e:
        raise ValueError(f"speculative_config: the MTP layer {prefix[:-1]}: {e}") from None
    values = dict(nnx.to_flat_state(state))
    for key in expected:
        if key in _OWN_PATHS:
            if key not in filled:
                raise ValueError(
                    f"speculative_config: the MTP layer {prefix[:-1]} lacks "
                    f"{'.'.join(map(str, key))}"
                )
            values[key] = expected[key].replace(filled[key])
    head = nnx.merge(graphdef, nnx.from_flat_state([(p, values[p]) for p in expected]))
    return head, config


_OWN_PATHS = {key for key, _ in _OWN.values()}
