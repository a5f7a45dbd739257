"""Loading an EAGLE-3 head from the layout vLLM loads (`LlamaForCausalLMEagle3` checkpoints
as EAGLE's and SpecForge's training writes them, and the speculators library's
`Eagle3Speculator`): config.json and safetensors with `fc.weight`, the layer as `midlayer.*` or
`layers.0.*` (with or without a `model.` prefix), `norm.weight`, `lm_head.weight` (the draft
vocabulary), `d2t` (draft id -> target id offsets; `t2d` is not needed) and optionally
`embed_tokens.weight` (else the target's embeddings are used). PyTorch `.bin` heads need a
conversion to safetensors first (this engine never unpickles)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxllm.config import REFERENCE_KERNELS, CompilationConfig, ModelConfig
from jaxllm.loaders.hf import iter_safetensors, safetensors_files
from jaxllm.model_files import resolve_model
from jaxllm.models.eagle3 import Eagle3Config, Eagle3Head, tensor_shapes
from jaxllm.sharding import param_shardings, shard_config

# Tensors a head may carry that serving does not read.
_UNUSED = ("t2d",)


def checkpoint_name(name: str) -> str:
    """A head tensor's name as vLLM's loader reads it: `midlayer.` is `layers.0.`, and any
    `model.` prefix dropped."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _tensor_names(path: Path, weights: bool) -> set[str]:
    """The checkpoint's tensor names as vLLM reads them; without `weights` (a config.json
    alone, as `jaxllm compile` takes) the ones a head of a smaller draft vocabulary has."""
    if not weights and not any(path.glob("*.safetensors")):
        return {"d2t"}
    if not any(path.glob("*.safetensors")) and any(path.glob("*.bin")):
        raise ValueError(
            f"speculative_config: the eagle3 head {path} has PyTorch .bin weights only; "
            "convert them to safetensors (safetensors.torch.save_file) to load it here"
        )
    names = set()
    for f in safetensors_files(path):
        with safe_open(f, framework="numpy") as st:
            names |= {checkpoint_name(n) for n in st.keys()}  # noqa: SIM118
    return names


def load_eagle3_config(path: Path, target: ModelConfig, *, weights: bool = True) -> Eagle3Config:
    """The head's config for `target`; `weights`: the directory must hold its weights."""
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"speculative_config: the eagle3 head {path} has no config.json")
    names = _tensor_names(path, weights)
    return Eagle3Config.from_hf_config(json.loads(config.read_text()), target, names)


def abstract_head(
    config: Eagle3Config, dtype, compilation: CompilationConfig, mesh
) -> tuple[Eagle3Config, nnx.GraphDef, nnx.State]:
    """The head as shapes (kv heads repeated for `mesh` as the target's are)."""
    if mesh is not None:
        config = dataclasses.replace(config, layer=shard_config(config.layer, mesh.shape["model"]))
    abstract = nnx.eval_shape(
        lambda: Eagle3Head(config, dtype=dtype, compilation=compilation, mesh=mesh, rngs=None)
    )
    graphdef, state = nnx.split(abstract)
    return config, graphdef, state


def _ours(name: str, w: np.ndarray, config: Eagle3Config) -> tuple[tuple[str, ...], np.ndarray]:
    """(our parameter path, the array in our layout) for a checkpoint tensor."""
    if name == "d2t":
        return ("d2t",), w.astype(np.int32)
    parts = tuple(name.removeprefix("layers.0.").removesuffix(".weight").split("."))
    if name.endswith("norm.weight"):
        return (*parts, "weight"), w
    if parts == ("embed_tokens",):  # [V, D] already
        return parts, w
    w = w.T  # torch's [out, in] -> [in, out]
    if parts[-1] in ("k_proj", "v_proj") and (r := config.layer.kv_head_replicas) > 1:
        h = config.layer.head_dim  # each checkpoint kv head repeated r times (sharding.py)
        w = np.repeat(w.reshape(w.shape[0], -1, 1, h), r, axis=2).reshape(w.shape[0], -1)
    return parts, w


def load_eagle3_head(
    model: str | os.PathLike,
    target: ModelConfig,
    *,
    dtype=jnp.float32,
    compilation: CompilationConfig = REFERENCE_KERNELS,
    mesh=None,
) -> tuple[Eagle3Head, Eagle3Config]:
    """The head at `model` for `target` (its config checked against the target's), its weights
    on the target's devices (replicated, or split over `mesh` as the target's are)."""
    path = resolve_model(model)
    if not path.is_dir():
        raise ValueError(f"speculative_config: the eagle3 head {path} is not a directory")
    config, graphdef, abstract = abstract_head(
        load_eagle3_config(path, target), dtype, compilation, mesh
    )
    # Shapes as the checkpoint stores them: the kv heads as it has them, before repeating.
    expected = tensor_shapes(dataclasses.replace(config, layer=_unsharded(config.layer)))
    arrays: dict[tuple, np.ndarray] = {}
    for raw_name, w in iter_safetensors(path):
        name = checkpoint_name(raw_name)
        if name in _UNUSED:
            continue
        if name not in expected:
            raise ValueError(
                f"speculative_config: the eagle3 head {path} has tensor {raw_name!r}, which an "
                "EAGLE-3 head of one Llama layer does not (see jaxllm.models.eagle3)"
            )
        if tuple(w.shape) != expected[name]:
            raise ValueError(
                f"speculative_config: the eagle3 head's {raw_name} is {list(w.shape)}, its "
                f"config.json makes it {list(expected[name])}"
            )
        key, value = _ours(name, np.asarray(w), config)
        arrays[key] = value
    if not config.has_d2t:  # a head over the whole vocabulary: its ids are the target's
        arrays[("d2t",)] = np.zeros(config.draft_vocab_size, np.int32)
    ids = np.arange(config.draft_vocab_size) + arrays[("d2t",)]
    if ids.min() < 0 or ids.max() >= target.vocab_size:
        raise ValueError(
            f"speculative_config: the eagle3 head {path}'s d2t maps draft ids outside the "
            f"target's vocabulary [0, {target.vocab_size})"
        )
    shardings = None if mesh is None else param_shardings(abstract, mesh)
    filled = []
    for path_, var in nnx.to_flat_state(abstract):
        key = tuple(str(k) for k in path_)
        if key not in arrays:
            raise ValueError(f"speculative_config: the eagle3 head {path} lacks {'.'.join(key)}")
        value = jnp.asarray(arrays.pop(key), var.get_value().dtype)
        if shardings is not None:
            value = jax.device_put(value, shardings[path_])
        filled.append((path_, var.replace(value)))
    head = nnx.merge(graphdef, nnx.from_flat_state(filled))
    return head, config


def _unsharded(layer: ModelConfig) -> ModelConfig:
    r = layer.kv_head_replicas
    if r == 1:
        return layer
    return dataclasses.replace(layer, num_kv_heads=layer.num_kv_heads // r, kv_head_replicas=1)
