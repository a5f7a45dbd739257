"""The vision side of an image-text checkpoint (`jaxllm.models.vision`): its tensors, read
from the same safetensors files as the text decoder's (which skips them), renamed to the
encoder's parameters and placed on the mesh as their logical axes say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm.loaders.hf import iter_safetensors
from jaxllm.models.qwen_vision import QwenVisionConfig, QwenVisionEncoder
from jaxllm.models.vision import VisionConfig, VisionEncoder
from jaxllm.sharding import param_shardings

# Where checkpoints put the vision side: transformers 5 under "model.", older ones at the top,
# and the tower's own modules under "vision_model." (CLIPVisionModel) or not.
_PREFIX = re.compile(r"^(?:model\.)?(vision_tower|multi_modal_projector)\.(?:vision_model\.)?")
# Qwen2-VL's and Qwen2.5-VL's: "visual." (as their checkpoints are saved) or "model.visual.".
_QWEN_PREFIX = re.compile(r"^(?:model\.)?visual\.")
_QWEN_BLOCK = re.compile(r"^blocks\.(\d+)\.(?:attn|mlp)?\.?(\w+)\.(weight|bias)$")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "layer_norm1": "layer_norm1",
    "layer_norm2": "layer_norm2",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.out_proj": "out_proj",
    "mlp.fc1": "fc1",
    "mlp.fc2": "fc2",
}


def is_vision_tensor(name: str) -> bool:
    return _PREFIX.match(name) is not None or _QWEN_PREFIX.match(name) is not None


def vision_config(
    path: Path, processor_kwargs: dict | None = None
) -> VisionConfig | QwenVisionConfig | None:
    """The checkpoint's vision side, or None for a text-only model (or a GGUF file);
    `processor_kwargs`: `--mm-processor-kwargs`, over its image processor's settings."""
    config_file = Path(path) / "config.json"
    if not Path(path).is_dir() or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get("model_type") in ("qwen2_vl", "qwen2_5_vl"):
        processor = Path(path) / "preprocessor_config.json"
        settings = json.loads(processor.read_text()) if processor.is_file() else {}
        return QwenVisionConfig.from_hf_config(config, settings, processor_kwargs or {})
    if "vision_config" not in config or config.get("model_type") not in ("llava", "gemma3"):
        return None
    return VisionConfig.from_hf_config(config)


def _qwen_target(name: str, config: QwenVisionConfig) -> tuple[tuple, bool]:
    """`_target` for Qwen2-VL's and Qwen2.5-VL's towers: (path, transposed)."""
    rest = name[_QWEN_PREFIX.match(name).end() :]
    if rest == "patch_embed.proj.weight":  # Conv3d [D, C, T, p, p] as one matmul
        return ("patch_embed",), True
    block = _QWEN_BLOCK.match(rest)
    if block:
        index, module, leaf = int(block.group(1)), block.group(2), block.group(3)
        return ("blocks", index, module, leaf), leaf == "weight" and "norm" not in module
    merger = None
    if rest.startswith("merger.ln_q."):
        merger = ("ln_q", rest.removeprefix("merger.ln_q."))
    elif rest.startswith("merger.mlp."):
        index, leaf = rest.removeprefix("merger.mlp.").split(".")
        merger = (f"mlp_{index}", leaf)
    if merger is None:
        raise ValueError(f"unexpected vision tensor {name!r}")
    return ("merger", *merger), merger[1] == "weight" and merger[0] != "ln_q"


def _target(name: str, config: VisionConfig) -> tuple[tuple, bool] | None:
    """(our parameter path, whether the weight is torch's [out, in] to transpose), or None
    to skip the tensor."""
    if isinstance(config, QwenVisionConfig):
        return _qwen_target(name, config)
    m = _PREFIX.match(name)
    part, rest = m.group(1), name[m.end() :]
    if part == "multi_modal_projector":
        if rest == "mm_input_projection_weight":  # Gemma 3's: [vision, text] already
            return (part, rest), False
        module, _, leaf = rest.rpartition(".")
        return (part, module, leaf), leaf == "weight" and "norm" not in module
    rest = rest.removeprefix("embeddings.")
    if rest.startswith("head.") or (rest.startswith("post_layernorm.") and not config.post_norm):
        return None  # SigLIP's pooling head, a norm the features are read before
    if rest in ("class_embedding", "position_embedding.weight"):
        return (part, rest.split(".")[0]), False
    layer = _LAYER.match(rest)
    if layer:
        index, suffix = int(layer.group(1)), layer.group(2)
        if index >= config.num_layers:
            return None  # past the layer whose features are read: never run
        module, _, leaf = suffix.rpartition(".")
        if module not in _LAYER_NAMES:
            raise ValueError(f"unexpected vision tensor {name!r}")
        ours = _LAYER_NAMES[module]
        return (part, "layers", index, ours, leaf), leaf == "weight" and "norm" not in ours
    module, _, leaf = rest.rpartition(".")
    if module not in ("patch_embedding", "pre_layrnorm", "post_layernorm"):
        raise ValueError(f"unexpected vision tensor {name!r}")
    return (part, module, leaf), module == "patch_embedding" and leaf == "weight"


def encoder_class(config: VisionConfig | QwenVisionConfig) -> type:
    """The vision encoder module of a `vision_config`."""
    return QwenVisionEncoder if isinstance(config, QwenVisionConfig) else VisionEncoder


def load_vision_encoder(
    path: Path,
    config: VisionConfig | QwenVisionConfig,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
) -> VisionEncoder | QwenVisionEncoder:
    """The checkpoint's vision encoder with its weights (every parameter must come)."""
    module = encoder_class(config)
    abstract = nnx.eval_shape(lambda: module(config, dtype=dtype, rngs=None))
    graphdef, state = nnx.split(abstract)
    expected = dict(nnx.to_flat_state(state))
    shardings = None if mesh is None else param_shardings(state, mesh)
    filled = {}
    for name, tensor in iter_safetensors(path, _VisionTensors()):
        target = _target(name, config)
        if target is None:
            continue
        key, transposed = target
        if key not in expected:
            raise ValueError(f"vision tensor {name!r} has no place in the encoder ({key})")
        value = np.asarray(tensor, np.float32)
        if transposed:
            value = value.reshape(value.shape[0], -1).T
        var = expected[key]
        if value.shape != var.shape:
            raise ValueError(
                f"vision tensor {name!r}: shape {value.shape} does not match the encoder's "
                f"{var.shape} (from the config)"
            )
        value = value.astype(jnp.dtype(dtype))
        placed = (
            jnp.asarray(value)
            if shardings is None
            else jax.make_array_from_callback(value.shape, shardings[key], lambda i, v=value: v[i])
        )
        filled[key] = var.replace(placed)
    missing = [".".join(map(str, k)) for k in expected if k not in filled]
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} vision parameter(s), e.g. {missing[:3]}"
        )
    return nnx.merge(graphdef, nnx.from_flat_state([(k, filled[k]) for k in expected]))


class _VisionTensors:
    """The vision side's names, as a container `iter_safetensors` reads only those of."""

    def __contains__(self, name: str) -> bool:
        return is_vision_tensor(name)
