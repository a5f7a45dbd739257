"""Hugging Face tensor names and layouts -> our parameter tree.

Both loaders speak Hugging Face here: the safetensors loader yields its tensors as they are, and
the GGUF loader renames and un-permutes llama.cpp's tensors into the same names and layouts
first. So this file is the one place that knows how a torch `Linear` ([out, in]) becomes one of
our einsum-shaped parameters ("DNH", "NHD", "DF", ...).

Every tensor goes to the device as soon as it is read (each decoder layer has parameters of
its own, so nothing waits for the other layers).
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
    d, n, h = c.hidden_size, c.num_heads, c.head_dim
    r = c.kv_head_replicas
    k = c.num_kv_heads // r  # the checkpoint's kv heads; each repeated r times (sharding.py)
    same = lambda w: w  # noqa: E731

    def kv(w: np.ndarray, *shape: int) -> np.ndarray:
        w = w.reshape(*shape)
        return w if r == 1 else np.repeat(w, r, axis=len(shape) - 2)

    return {
        "input_layernorm.weight": (("input_layernorm", "weight"), same),
        "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), same),
        "self_attn.q_proj.weight": (("self_attn", "q_proj"), lambda w: w.T.reshape(d, n, h)),
        "self_attn.k_proj.weight": (("self_attn", "k_proj"), lambda w: kv(w.T, d, k, h)),
        "self_attn.v_proj.weight": (("self_attn", "v_proj"), lambda w: kv(w.T, d, k, h)),
        "self_attn.o_proj.weight": (("self_attn", "o_proj"), lambda w: w.T.reshape(n, h, d)),
        "self_attn.q_proj.bias": (("self_attn", "q_bias"), lambda w: w.reshape(n, h)),
        "self_attn.k_proj.bias": (("self_attn", "k_bias"), lambda w: kv(w, k, h)),
        "self_attn.v_proj.bias": (("self_attn", "v_bias"), lambda w: kv(w, k, h)),
        "mlp.gate_proj.weight": (("mlp", "gate_proj"), lambda w: w.T),
        "mlp.up_proj.weight": (("mlp", "up_proj"), lambda w: w.T),
        "mlp.down_proj.weight": (("mlp", "down_proj"), lambda w: w.T),
    }


def hf_to_path(
    name: str, config: ModelConfig
) -> tuple[tuple[str | int, ...], Callable[[np.ndarray], np.ndarray]] | None:
    """(our parameter path, layout transform) for an HF tensor name; None to skip the
    tensor."""
    same = lambda w: w  # noqa: E731
    if name == "model.embed_tokens.weight":
        return ("embed_tokens",), same
    if name == "model.norm.weight":
        return ("norm", "weight"), same
    if name == "lm_head.weight":
        # Some tied checkpoints still ship a copy of the embedding as lm_head: skip it.
        return None if config.tie_word_embeddings else (("lm_head",), lambda w: w.T)
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer in old checkpoints, recomputed from rope_theta
    m = _LAYER.match(name)
    if m:
        rule = _rules(config).get(m.group(2))
        layer = int(m.group(1))
        if rule is not None and layer < config.num_layers:
            return ("layers", layer, *rule[0]), rule[1]
    raise ValueError(f"unexpected tensor {name!r} in checkpoint for {config.architecture}")


def _to_numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else np.asarray(x)


def build_state(
    abstract_state: nnx.State,
    tensors: Iterable[tuple[str, np.ndarray | jax.Array]],
    config: ModelConfig,
    dtype: jnp.dtype,
    shardings: dict[tuple, jax.sharding.Sharding] | None = None,
) -> nnx.State:
    """Fills an abstract model state from (HF name, tensor) pairs; every parameter must come.
    With `shardings` ({path: sharding}), each device receives only its own slice of each
    parameter, straight from the host buffer: no parameter is ever whole on one device."""
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}

    def place(path: tuple, value: np.ndarray) -> jax.Array:
        if shardings is None:
            return jnp.asarray(value, dtype=dtype)
        value = value.astype(np_dtype, copy=False)
        return jax.make_array_from_callback(value.shape, shardings[path], lambda i: value[i])

    filled: dict[tuple, nnx.Variable] = {}
    np_dtype = np.dtype(jnp.dtype(dtype))
    for name, tensor in tensors:
        target = hf_to_path(name, config)
        if target is None:
            continue
        path, transform = target
        if path not in expected:
            raise ValueError(f"tensor {name!r} has no place in the model (path {path})")
        var = expected[path]
        value = transform(_to_numpy(tensor))
        if value.shape != var.shape:
            raise ValueError(
                f"tensor {name!r}: shape {value.shape} after conversion does not match the "
                f"model's {var.shape} (from the config)"
            )
        if path in filled:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        filled[path] = var.replace(place(path, value))
    missing = [".".join(map(str, p)) for p in expected if p not in filled]
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} parameter(s), e.g. {', '.join(missing[:5])}"
        )
    return nnx.from_flat_state([(p, filled[p]) for p in expected])
