"""Hugging Face tensor names and layouts -> our parameter tree.

Both loaders speak Hugging Face here: the safetensors loader yields its tensors as they are, and
the GGUF loader renames and un-permutes llama.cpp's tensors into the same names and layouts
first. So this file is the one place that knows how a torch `Linear` ([out, in]) becomes one of
our einsum-shaped parameters ("DNH", "NHD", "DF", ...).

Tensors are converted and placed on the device one at a time, so the host never holds more
than one converted tensor beside whatever the source keeps memory-mapped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _rules(c: ModelConfig) -> dict[str, tuple[tuple[str, ...], Callable[[np.ndarray], np.ndarray]]]:
    """Per-layer HF suffix -> (our path inside the layer, transform from the HF layout)."""
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    same = lambda w: w  # noqa: E731
    return {
        "input_layernorm.weight": (("input_layernorm", "weight"), same),
        "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), same),
        "self_attn.q_proj.weight": (("self_attn", "q_proj"), lambda w: w.T.reshape(d, n, h)),
        "self_attn.k_proj.weight": (("self_attn", "k_proj"), lambda w: w.T.reshape(d, k, h)),
        "self_attn.v_proj.weight": (("self_attn", "v_proj"), lambda w: w.T.reshape(d, k, h)),
        "self_attn.o_proj.weight": (("self_attn", "o_proj"), lambda w: w.T.reshape(n, h, d)),
        "self_attn.q_proj.bias": (("self_attn", "q_bias"), lambda w: w.reshape(n, h)),
        "self_attn.k_proj.bias": (("self_attn", "k_bias"), lambda w: w.reshape(k, h)),
        "self_attn.v_proj.bias": (("self_attn", "v_bias"), lambda w: w.reshape(k, h)),
        "mlp.gate_proj.weight": (("mlp", "gate_proj"), lambda w: w.T),
        "mlp.up_proj.weight": (("mlp", "up_proj"), lambda w: w.T),
        "mlp.down_proj.weight": (("mlp", "down_proj"), lambda w: w.T),
    }


def hf_to_path(
    name: str, config: ModelConfig
) -> tuple[tuple[str | int, ...], Callable[[np.ndarray], np.ndarray]] | None:
    """Our parameter path and layout transform for an HF tensor name; None to skip it."""
    if name == "model.embed_tokens.weight":
        return ("embed_tokens",), lambda w: w
    if name == "model.norm.weight":
        return ("norm", "weight"), lambda w: w
    if name == "lm_head.weight":
        # Some tied checkpoints still ship a copy of the embedding as lm_head: skip it.
        return None if config.tie_word_embeddings else (("lm_head",), lambda w: w.T)
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer in old checkpoints, recomputed from rope_theta
    m = _LAYER.match(name)
    if m:
        rule = _rules(config).get(m.group(2))
        if rule is not None:
            return ("layers", int(m.group(1)), *rule[0]), rule[1]
    raise ValueError(f"unexpected tensor {name!r} in checkpoint for {config.architecture}")


def _to_numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else np.asarray(x)


def build_state(
    abstract_state: nnx.State,
    tensors: Iterable[tuple[str, np.ndarray | jax.Array]],
    config: ModelConfig,
    dtype: jnp.dtype,
) -> nnx.State:
    """Fills an abstract model state from (HF name, tensor) pairs; every parameter must come."""
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}
    filled: dict[tuple, nnx.Variable] = {}
    for name, tensor in tensors:
        target = hf_to_path(name, config)
        if target is None:
            continue
        path, transform = target
        if path not in expected:
            raise ValueError(f"tensor {name!r} has no place in the model (path {path})")
        if path in filled:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        var = expected[path]
        value = transform(_to_numpy(tensor))
        if value.shape != var.shape:
            raise ValueError(
                f"tensor {name!r}: shape {value.shape} after conversion does not match the "
                f"model's {var.shape} (from the config)"
            )
        filled[path] = var.replace(jnp.asarray(value, dtype=dtype))
    missing = [".".join(map(str, p)) for p in expected if p not in filled]
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} parameter(s), e.g. {', '.join(missing[:5])}"
        )
    return nnx.from_flat_state([(p, filled[p]) for p in expected])
