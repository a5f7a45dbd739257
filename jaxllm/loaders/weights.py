"""Hugging Face tensor names and layouts -> our parameter tree.

Both loaders speak Hugging Face here: the safetensors loader yields its tensors as they are, and
the GGUF loader renames and un-permutes llama.cpp's tensors into the same names and layouts
first. So this file is the one place that knows how a torch `Linear` ([out, in]) becomes one of
our einsum-shaped parameters ("DNH", "NHD", "DF", ...).

Every tensor goes to the device as soon as it is read (each decoder layer has parameters of
its own, so nothing waits for the other layers).

Quantized weights (`jaxllm.quantization`) stay in torch's [out, in] layout: a tensor that
arrives quantized (a GGUF block type) or that `quantization` asks to quantize becomes a
`QArray` on the host, and only output rows are ever moved (repeated kv heads), never a float
round trip.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.families import family_of, image_text_tensor_name
from jaxllm.models.layers import _num_in_axes
from jaxllm.quantization import (
    FORMATS,
    HEAD_IMPORTANCE_POWER,
    KEPT_EXPERTS,
    MXFP4_BLOCK,
    QUANTIZABLE,
    FP8Experts,
    MXFP4Experts,
    QArray,
    SplitRows,
    abstract_fp8_experts,
    abstract_head,
    abstract_mxfp4_experts,
    abstract_qarray,
    dequantize_np,
    quantize,
    quantize_head,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@functools.cache  # one table per model and head shape, not per tensor
def _rules(
    c: ModelConfig, h: int, kv_heads: int
) -> dict[str, list[tuple[tuple[str, ...], Callable]]]:
    """Per-layer HF suffix -> [(our path inside the layer, transform from the HF layout)]: one
    target, or several for a tensor that holds several of our parameters (gpt-oss's fused
    `gate_up_proj`). `h`, `kv_heads`: the layer's head width and kv heads (Gemma 4's full
    layers differ from its sliding ones)."""
    d = c.hidden_size
    r = c.kv_head_replicas
    k = kv_heads // r  # the checkpoint's kv heads; each repeated r times (sharding.py)
    same = lambda w: w  # noqa: E731

    def kv(w: np.ndarray, *shape: int) -> np.ndarray:
        """A kv projection's [..., K * H] columns with each head repeated r times."""
        if r == 1:
            return w
        return np.repeat(w.reshape(*shape), r, axis=len(shape) - 2).reshape(*shape[:-2], -1)

    rules = {
        f"{norm}.weight": ((norm, "weight"), same)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            # Gemma 4's MoE block's norms, and its per-layer input's
            "post_feedforward_layernorm_1",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_2",
        )
    }
    gemma4 = {
        "layer_scalar": (("layer_scalar",), same),
        "per_layer_input_gate.weight": (("per_layer", "per_layer_input_gate"), lambda w: w.T),
        "per_layer_projection.weight": (("per_layer", "per_layer_projection"), lambda w: w.T),
        "post_per_layer_input_norm.weight": (
            ("per_layer", "post_per_layer_input_norm", "weight"),
            same,
        ),
        "moe.router.weight": (("moe", "router"), lambda w: w.T),
        "moe.router_scale": (("moe", "router_scale"), same),
        "moe.router_per_expert_scale": (("moe", "per_expert_scale"), same),
        # Output-major experts ([E, 2F, D] gate then up, [E, D, F]) -> ours, input-major.
        "moe.experts.gate_up_proj_output_major": [
            (("moe", "gate_proj"), lambda w: np.split(w, 2, axis=1)[0].transpose(0, 2, 1)),
            (("moe", "up_proj"), lambda w: np.split(w, 2, axis=1)[1].transpose(0, 2, 1)),
        ],
        "moe.experts.down_proj_output_major": (
            ("moe", "down_proj"),
            lambda w: w.transpose(0, 2, 1),
        ),
    }
    even, odd = (lambda w: w[..., 0::2]), (lambda w: w[..., 1::2])
    halves = [(lambda w, i=i: np.split(w, 2, axis=-1)[i]) for i in range(2)]
    table = (
        rules
        | {
            "self_attn.q_norm.weight": (("self_attn", "q_norm", "weight"), same),
            "self_attn.k_norm.weight": (("self_attn", "k_norm", "weight"), same),
            "self_attn.q_proj.weight": (("self_attn", "q_proj"), lambda w: w.T),
            "self_attn.k_proj.weight": (("self_attn", "k_proj"), lambda w: kv(w.T, d, k, h)),
            "self_attn.v_proj.weight": (("self_attn", "v_proj"), lambda w: kv(w.T, d, k, h)),
            "self_attn.o_proj.weight": (("self_attn", "o_proj"), lambda w: w.T),
            "self_attn.q_proj.bias": (("self_attn", "q_bias"), same),
            "self_attn.k_proj.bias": (("self_attn", "k_bias"), lambda w: kv(w, k, h)),
            "self_attn.v_proj.bias": (("self_attn", "v_bias"), lambda w: kv(w, k, h)),
            "self_attn.o_proj.bias": (("self_attn", "o_bias"), same),
            # Latent attention (`jaxllm.models.mla`)
            **{
                f"self_attn.{proj}.weight": (("self_attn", proj), lambda w: w.T)
                for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
            },
            **{
                f"self_attn.{norm}.weight": (("self_attn", norm, "weight"), same)
                for norm in ("q_a_layernorm", "kv_a_layernorm")
            },
            "mlp.router_score_bias": (("mlp", "score_bias"), same),
            "mlp.gate_proj.weight": (("mlp", "gate_proj"), lambda w: w.T),
            "mlp.up_proj.weight": (("mlp", "up_proj"), lambda w: w.T),
            "mlp.down_proj.weight": (("mlp", "down_proj"), lambda w: w.T),
            # Mixture of experts: the router, and (below) each expert's slice of [E, ...] weights.
            "mlp.gate.weight": (("mlp", "router"), lambda w: w.T),
            "mlp.shared_expert_gate.weight": (("mlp", "shared_expert_gate"), lambda w: w.T),
            **{
                f"mlp.shared_expert.{proj}.weight": (("mlp", "shared_expert", proj), lambda w: w.T)
                for proj in ("gate_proj", "up_proj", "down_proj")
            },
            # gpt-oss and Llama 4: a router named so (gpt-oss's with a bias); the experts
            # stacked in one tensor each, input-major ([E, D, 2F], [E, F, D]), gate and up
            # interleaved column by column (gpt-oss, with biases) or in halves (Llama 4), as
            # the families name them; gpt-oss's per-head sinks.
            "self_attn.sinks": (("self_attn", "sinks"), same),
            "mlp.router.weight": (("mlp", "router"), lambda w: w.T),
            "mlp.router.bias": (("mlp", "router_bias"), same),
            "mlp.experts.gate_up_proj_interleaved": [
                (("mlp", "gate_proj"), even),
                (("mlp", "up_proj"), odd),
            ],
            "mlp.experts.gate_up_proj_interleaved_bias": [
                (("mlp", "gate_bias"), even),
                (("mlp", "up_bias"), odd),
            ],
            "mlp.experts.gate_up_proj_concatenated": [
                (("mlp", "gate_proj"), halves[0]),
                (("mlp", "up_proj"), halves[1]),
            ],
            "mlp.experts.down_proj": (("mlp", "down_proj"), same),
            "mlp.experts.down_proj_bias": (("mlp", "down_bias"), same),
            # A GGUF file's stacked experts, input-major ([E, D, F], [E, F, D]; `loaders.gguf`).
            **{
                f"mlp.experts.{p}_proj_stacked{suffix}": (("mlp", f"{p}_{kind}"), same)
                for p in ("gate", "up", "down")
                for suffix, kind in (("", "proj"), ("_bias", "bias"))
            },
        }
        | gemma4
        | (_linear_attention_rules(c) if c.linear_attention else {})
    )
    return {k: v if isinstance(v, list) else [v] for k, v in table.items()}


def _linear_attention_rules(c: ModelConfig) -> dict:
    """A Gated DeltaNet layer's tensors (`jaxllm.models.linear_attention`), its channels by key
    head group: Qwen3-Next's fused projections are laid out so already; Qwen3.5's
    `in_proj_qkv` and every convolution have [q | k | v] heads-major, reordered into it."""
    la = c.linear_attention
    r = la.num_value_heads // la.num_key_heads
    widths = [la.key_head_dim * la.num_key_heads] * 2 + [la.value_dim]
    per_group = [la.key_head_dim, la.key_head_dim, r * la.value_head_dim]
    same = lambda w: w  # noqa: E731

    def by_group(w: np.ndarray) -> np.ndarray:
        """[..., q | k | v] -> [..., per key head g: q_g k_g v_g]."""
        parts = np.split(w, np.cumsum(widths)[:-1], axis=-1)
        lead = w.shape[:-1]
        heads = [
            p.reshape(*lead, la.num_key_heads, n) for p, n in zip(parts, per_group, strict=True)
        ]
        return np.concatenate(heads, axis=-1).reshape(*lead, -1)

    rules = {
        "in_proj_qkvz.weight": (("in_proj_qkvz",), lambda w: w.T),
        "in_proj_ba.weight": (("in_proj_ba",), lambda w: w.T),
        "in_proj_qkv.weight": (("in_proj_qkv",), lambda w: by_group(w.T)),
        "in_proj_z.weight": (("in_proj_z",), lambda w: w.T),
        "in_proj_b.weight": (("in_proj_b",), lambda w: w.T),
        "in_proj_a.weight": (("in_proj_a",), lambda w: w.T),
        "conv1d.weight": (("conv1d",), lambda w: by_group(w[:, 0, :].T)),  # [C, 1, K] -> [K, C]
        "dt_bias": (("dt_bias",), same),
        "A_log": (("A_log",), same),
        "norm.weight": (("norm_weight",), same),
        "out_proj.weight": (("out_proj",), lambda w: w.T),
    }
    return {f"linear_attn.{k}": (("linear_attn", *path), f) for k, (path, f) in rules.items()}


# An expert's projection -> our stacked weight (Qwen3-MoE's names; a family with names of its
# own renames them to these, see `Family.tensor_name`).
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


Target = tuple[tuple[str | int, ...], Callable[[np.ndarray], np.ndarray], int | None]


def hf_to_path(name: str, config: ModelConfig) -> list[Target]:
    """[(our parameter path, layout transform, index)] for an HF tensor name (several for a
    tensor that holds several parameters), or [] to skip the tensor. `index` is an expert's
    row of a stacked [E, ...] weight; None: the whole parameter. The family renames its own
    tensor names to Llama's first."""
    target = _hf_to_path(name, config)
    return target if isinstance(target, list) else [] if target is None else [target]


def _hf_to_path(name: str, config: ModelConfig) -> Target | list[Target] | None:
    same = lambda w: w  # noqa: E731
    original, name = name, image_text_tensor_name(name)
    if name is None:
        return None  # an image-text checkpoint's vision side (`loaders.vision`)
    family = family_of(config.architecture)
    name = family.tensor_name(name)
    if name is None:
        return None
    if name.startswith("layers.") or name in ("embed_tokens.weight", "norm.weight"):
        name = f"model.{name}"  # a base model's checkpoint (Qwen3Model): no "model." prefix
    if name == "model.embed_tokens.weight":
        return ("embed_tokens",), same, None
    if name == "model.norm.weight":
        return ("norm", "weight"), same, None
    if name in _PER_LAYER_INPUTS:  # Gemma 4's
        path, f = _PER_LAYER_INPUTS[name]
        return ("per_layer_inputs", *path), f, None
    if name == "lm_head.weight":
        # Some tied checkpoints still ship a copy of the embedding as lm_head: skip it.
        return None if config.tie_word_embeddings else (("lm_head",), lambda w: w.T, None)
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer in old checkpoints, recomputed from rope_theta
    if name == "score.weight":
        return None  # a classifier's head: read by jaxllm.classifier
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= config.num_layers and family.layers_past_the_last_skipped:
        return None
    if m and int(m.group(1)) < config.num_layers:
        layer, suffix = int(m.group(1)), m.group(2)
        if config.layer_kv_source(layer) != layer and suffix in _OWN_KV:
            return None  # a layer sharing another's KV (Gemma 4) has none of its own
        shape = config.layer_head_dim(layer), config.layer_num_kv_heads(layer)
        rule = _rules(config, *shape).get(suffix)
        if rule is not None:
            return [(("layers", layer, *path), f, None) for path, f in rule]
        e = _EXPERT.match(suffix)
        if e and int(e.group(1)) < config.num_experts:
            return ("layers", layer, "mlp", e.group(2)), lambda w: w.T, int(e.group(1))
    raise ValueError(f"unexpected tensor {original!r} in checkpoint for {config.architecture}")


_PER_LAYER_INPUTS = {
    "model.embed_tokens_per_layer.weight": (("embed_tokens_per_layer",), lambda w: w),
    "model.per_layer_model_projection.weight": (("per_layer_model_projection",), lambda w: w.T),
    "model.per_layer_projection_norm.weight": (
        ("per_layer_projection_norm", "weight"),
        lambda w: w,
    ),
}
_OWN_KV = {
    f"self_attn.{name}.{kind}"
    for name in ("k_proj", "v_proj", "k_norm", "v_norm")
    for kind in ("weight", "bias")
}

_QK_WEIGHT = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.[qk]_proj\.weight$")
# Latent attention's: each query head's [P | R] rows, and the latent's [L | R] rows, whose
# last R (the RoPE part) turn.
_MLA_ROPE_WEIGHT = re.compile(
    r"^(model\.)?layers\.\d+\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.weight$"
)


def rope_pairs_as_halves(
    tensors: Iterable[tuple[str, np.ndarray | QArray]], config: ModelConfig
) -> Iterator[tuple[str, np.ndarray | QArray]]:
    """(name, tensor) pairs with each q and k projection's output channels reordered, per head,
    from RoPE's adjacent pairs (2i, 2i + 1) to halves (i, i + H / 2), for a checkpoint whose
    RoPE turns adjacent pairs (`ModelConfig.rope_interleaved`): the decoder's RoPE then turns
    the same pairs, and every score is unchanged. With latent attention, the RoPE part of each
    query head and of the latent's projection (the last `head_dim` rows of each). Other
    tensors pass."""
    h = config.head_dim
    mla = config.latent_attention

    def reorder(w: np.ndarray) -> np.ndarray:  # [heads * H, ...] rows
        return w.reshape(-1, h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def reorder_tails(block: int):
        def tails(w: np.ndarray) -> np.ndarray:  # [blocks * block, ...] rows
            rows = w.reshape(-1, block, *w.shape[1:])
            tail = reorder(rows[:, block - h :].reshape(-1, *w.shape[1:]))
            rows = np.concatenate([rows[:, : block - h], tail.reshape(-1, h, *w.shape[1:])], 1)
            return rows.reshape(w.shape)

        return tails

    pattern = _QK_WEIGHT if mla is None else _MLA_ROPE_WEIGHT
    for name, tensor in tensors:
        text_name = image_text_tensor_name(name)  # None: a vision tower's (its own RoPE)
        m = None if text_name is None else pattern.match(text_name)
        if m is not None:
            if mla is None:
                f = reorder
            elif m.group(2) == "kv_a_proj_with_mqa":
                f = reorder_tails(mla.kv_lora_rank + h)
            else:
                f = reorder_tails(mla.qk_nope_head_dim + h)
            tensor = tensor.map_rows(f) if isinstance(tensor, QArray) else f(_to_numpy(tensor))
        yield name, tensor


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, QArray):  # a quantized tensor whose parameter stays float or is requantized
        return dequantize_np(x)
    return x if isinstance(x, np.ndarray) else np.asarray(x)


def _quantized(name: str, *args, **kwargs) -> QArray | SplitRows | None:
    """`_quantize_tensor`, its errors naming the tensor."""
    try:
        return _quantize_tensor(name, *args, **kwargs)
    except ValueError as e:
        raise ValueError(f"tensor {name!r}: {e}") from e


def _quantize_tensor(
    name: str,
    tensor,
    path: tuple,
    var: nnx.Variable,
    config: ModelConfig,
    quantization: str | None,
    dtype,
    importance: np.ndarray | None = None,
    *,
    head: bool = False,
) -> QArray | SplitRows | None:
    """The QArray that parameter `path` gets from HF tensor `tensor` ([out, in], float or
    already quantized), or None when the parameter stays float. `head`: the output head,
    which int4 quantizes by `quantize_head`, with `importance` (see `build_state`)."""
    if path[-1] not in QUANTIZABLE or "expert" in var.get_metadata().get("axes", ()):
        return None
    if quantization == "float":
        return None
    fmt = quantization
    if fmt not in FORMATS:
        if not isinstance(tensor, QArray):
            return None
        w = tensor
    else:
        w = _to_numpy(tensor)  # a quantized tensor dequantized first
        w = quantize_head(w, importance) if head and fmt == "int4" else quantize(w, fmt)
    if path[-1] == "embed_tokens":  # [V, D]: rows are tokens, the tied head's outputs
        out_shape, num_in = var.shape[:1], var.shape[1]
    else:
        num_in = w.num_in
        out_shape = var.shape[_num_in_axes(var.shape, num_in) :]
    num_out = int(np.prod(out_shape))
    if w.num_out != num_out and num_out % w.num_out == 0 and path[-1] in ("k_proj", "v_proj"):
        h = config.layer_head_dim(path[1]) if path[0] == "layers" else config.head_dim
        heads, r = w.num_out // h, num_out // w.num_out  # kv heads repeated
        w = w.map_rows(
            lambda a: np.repeat(a.reshape(heads, -1, *a.shape[1:]), r, axis=0).reshape(
                -1, *a.shape[1:]
            )
        )
    if w.shape != (num_out, num_in):
        raise ValueError(
            f"quantized shape {w.shape} does not match the model's {(num_out, num_in)} (from "
            "the config)"
        )
    return w.with_output(out_shape, dtype)


def _qarray_shardings(
    w: QArray | SplitRows, sharding: jax.sharding.Sharding, var_shape, embed: bool
):
    """The shardings of a QArray's leaves, from the float parameter's: rows split as the
    output axes were (where they divide), columns as the input axes were where every shard
    then holds whole groups (and whole int4 blocks); otherwise those rows or columns stay
    whole on each device. Without a mesh (one device) every leaf takes the parameter's
    sharding. A SplitRows' parts each so."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if not isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda _: sharding, w)
    if isinstance(w, SplitRows):
        parts = (_qarray_shardings(a, sharding, var_shape, embed) for a in (w.first, w.rest))
        return SplitRows(*parts)
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(var_shape) - len(sharding.spec))
    if embed:  # [V, D]: output-major already
        out_axes, in_axes = spec[:1], spec[1:]
    else:  # [*in, *out]
        num_in_axes = len(var_shape) - len(w.out_shape)
        out_axes, in_axes = spec[num_in_axes:], spec[:num_in_axes]
    out_axis = next((a for a in out_axes if a is not None), None)
    if out_axis is not None and w.num_out % mesh.shape[out_axis]:
        out_axis = None
    in_axis = next((a for a in in_axes if a is not None), None)
    shards = mesh.shape[in_axis] if in_axis is not None else 1
    q_in = in_axis if w.fmt != "int4" or (w.num_in // shards) % 32 == 0 else None
    s_in = in_axis if w.scale.shape[1] % shards == 0 else None
    q_sharding = NamedSharding(mesh, P(out_axis, q_in))
    s_sharding = NamedSharding(mesh, P(out_axis, s_in))
    return dataclasses.replace(
        w,
        q=q_sharding,
        scale=s_sharding,
        offset=None if w.offset is None else s_sharding,
        perm=None if w.perm is None else NamedSharding(mesh, P()),
    )


def kept_expert_shardings(w: MXFP4Experts | FP8Experts, sharding: jax.sharding.Sharding):
    """The shardings of MXFP4 (or FP8) experts' leaves, split as the float parameter [E, I,
    O] would be (`MXFP4Experts.specs`); inputs split only in whole groups (of 32 for MXFP4)."""
    from jax.sharding import NamedSharding

    if not isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda _: sharding, w)
    spec = tuple(sharding.spec) + (None,) * (3 - len(sharding.spec))
    if isinstance(w, FP8Experts):
        groups, size = w.scale.shape[-1], w.shape[1] // w.scale.shape[-1]
    else:
        groups, size = w.shape[1] // MXFP4_BLOCK, MXFP4_BLOCK
    if spec[1] is not None and groups % sharding.mesh.shape[spec[1]]:
        raise ValueError(
            f"quantized experts with {groups} groups of {size} inputs cannot be split over "
            f"{sharding.mesh.shape[spec[1]]} devices; use a tensor_parallel_size that divides "
            "the number of experts"
        )
    return jax.tree.map(lambda p: NamedSharding(sharding.mesh, p), w.specs(spec))


def abstract_state_for(
    abstract_state: nnx.State,
    config: ModelConfig,
    dtype: jnp.dtype,
    shardings: dict[tuple, jax.sharding.Sharding],
    quantization: str | None = None,
    *,
    mxfp4_experts: bool = False,
    fp8_experts: int | None = None,
    float_embeddings: bool = False,
) -> nnx.State:
    """The state `build_state` would build, as `jax.ShapeDtypeStruct`s placed by `shardings`
    ({path: sharding}): the model without its weights, for compiling it (`jaxllm.aot`).
    `quantization`: None or "float" (float weights), or a format quantized at load (int8, int4,
    fp8), whose QArrays take the shapes `quantize` gives them. `mxfp4_experts`: the experts'
    projections kept in MXFP4 (a gpt-oss checkpoint, `loaders.mxfp4_kept`); `fp8_experts`:
    kept in FP8 with factors for groups of this many inputs (0: one a row), as a fine-grained
    FP8 checkpoint's are (`loaders.fp8_experts_kept`); None: float. `float_embeddings`: the
    embedding and output head stay float whatever `quantization` says (as an FP8 checkpoint
    ships them)."""
    if quantization not in (None, "float", *FORMATS):
        raise ValueError(
            f"quantization {quantization} keeps a checkpoint's own quantized tensors, whose "
            "shapes a config alone does not give; compile with int8, int4, fp8 or none"
        )
    head = _head_path(config)
    out = []
    for path, var in nnx.to_flat_state(abstract_state):
        where = shardings[path]
        if mxfp4_experts and _is_expert_projection(path, var):
            w = abstract_mxfp4_experts(var.shape, dtype)
        elif fp8_experts is not None and _is_expert_projection(path, var):
            w = abstract_fp8_experts(var.shape, dtype, fp8_experts)
        elif (
            quantization in FORMATS
            and path[-1] in QUANTIZABLE
            and "expert" not in var.get_metadata().get("axes", ())
            and not (float_embeddings and path[-1] in ("embed_tokens", "lm_head"))
        ):
            w = _abstract_quantized(path, var, quantization, dtype, head)
        else:
            value = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=where)
            out.append((path, var.replace(value)))
            continue
        placed = _leaf_shardings(path, w, where, var.shape)
        value = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), w, placed
        )
        out.append((path, var.replace(value)))
    return nnx.from_flat_state(out)


def _abstract_quantized(path: tuple, var, quantization: str, dtype, head: tuple):
    """The abstract QArray (or int4 head's SplitRows) `quantize` would give parameter `path`."""
    if path[-1] == "embed_tokens":  # [V, D]: rows are tokens, the tied head's outputs
        out_shape, num_in = var.shape[:1], var.shape[1]
    else:
        num_in = _leading_in(var, path)
        out_shape = var.shape[_num_in_axes(var.shape, num_in) :]
    num_out = int(np.prod(out_shape))
    try:
        if path == head and quantization == "int4":
            w = abstract_head(num_out, num_in)
        else:
            w = abstract_qarray(quantization, num_out, num_in)
    except ValueError as e:
        raise ValueError(f"parameter {'.'.join(map(str, path))}: {e}") from e
    return w.with_output(out_shape, dtype)


def _head_path(config: ModelConfig) -> tuple:
    """The output head's parameter: the tied embedding, or lm_head."""
    return ("embed_tokens",) if config.tie_word_embeddings else ("lm_head",)


def _leaf_shardings(path: tuple, w, sharding: jax.sharding.Sharding, var_shape):
    """The shardings of a quantized parameter's leaves (QArray, SplitRows, MXFP4Experts or
    FP8Experts), from the float parameter's."""
    if isinstance(w, KEPT_EXPERTS):
        return kept_expert_shardings(w, sharding)
    return _qarray_shardings(w, sharding, var_shape, path[-1] == "embed_tokens")


def _is_expert_projection(path: tuple, var: nnx.Variable) -> bool:
    """Whether `path` is a stacked expert projection (what a checkpoint's MXFP4 experts fill)."""
    axes = var.get_metadata().get("axes", ())
    return path[-1] in ("gate_proj", "up_proj", "down_proj") and "expert" in axes


def _leading_in(var: nnx.Variable, path: tuple) -> int:
    """The input width of a [in, out] weight (every quantizable one but the embedding)."""
    return var.shape[0]


def param_dtype(var: nnx.Variable, dtype) -> jnp.dtype:
    """The dtype parameter `var` is loaded in: the model's `dtype`, but float32 for one the
    model keeps in float32 whatever its dtype (DeepSeek's router and its score bias)."""
    return jnp.dtype(jnp.float32 if var.dtype == jnp.float32 else dtype)


def _stack_fp8(
    name, w: QArray, index: int, path: tuple, var, stacking: dict, dtype
) -> FP8Experts | None:
    """Adds expert `index`'s fp8 weight [O, I] to its projection's `FP8Experts` host buffers;
    the whole stack once every expert has come, else None."""
    e, i, o = var.shape
    if w.shape != (o, i) or w.offset is not None or w.perm is not None:
        raise ValueError(
            f"tensor {name!r}: an fp8 expert of shape {w.shape} does not match the model's "
            f"{(o, i)} (from the config)"
        )
    q, scale, todo = stacking.setdefault(
        path,
        (
            np.empty((e, o, i), w.q.dtype),
            np.empty((e, o, w.scale.shape[1]), np.float32),
            set(range(e)),
        ),
    )
    if index not in todo or w.scale.shape[1] != scale.shape[2]:
        raise ValueError(f"tensor {name!r} appears twice in the checkpoint, or its blocks differ")
    q[index], scale[index] = np.asarray(w.q), np.asarray(w.scale, np.float32)
    todo.discard(index)
    if todo:
        return None
    del stacking[path]
    return FP8Experts(q, scale, np.dtype(dtype))


def build_state(
    abstract_state: nnx.State,
    tensors: Iterable[tuple[str, np.ndarray | jax.Array]],
    config: ModelConfig,
    dtype: jnp.dtype,
    shardings: dict[tuple, jax.sharding.Sharding] | None = None,
    quantization: str | None = None,
    *,
    keep_fp8_experts: bool = False,
) -> nnx.State:
    """Fills an abstract model state from (HF name, tensor) pairs; every parameter must come.
    `keep_fp8_experts`: an FP8 checkpoint's experts (fp8 QArrays, one an expert) are stacked
    into `FP8Experts` rather than dequantized (`loaders.fp8_experts_kept`).
    With `shardings` ({path: sharding}), each device receives only its own slice of each
    parameter, straight from the host buffer: no parameter is ever whole on one device.
    Tensors may be float arrays or QArrays; `quantization` is the engine's (see
    jaxllm.quantization)."""
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}

    def place(path: tuple, value: np.ndarray) -> jax.Array:
        want = np.dtype(param_dtype(expected[path], dtype))
        if shardings is None:
            return jnp.asarray(value, dtype=want)
        value = value.astype(want, copy=False)
        return jax.make_array_from_callback(value.shape, shardings[path], lambda i: value[i])

    def place_quantized(path: tuple, w: QArray | SplitRows | MXFP4Experts):
        if shardings is None:
            return jax.tree.map(jnp.asarray, w)
        where = _leaf_shardings(path, w, shardings[path], expected[path].shape)
        return jax.tree.map(
            lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), w, where
        )

    filled: dict[tuple, nnx.Variable] = {}
    # int4 quantizes the output head (the tied embedding, or lm_head) weighting its inputs by
    # the final norm's scale (`HEAD_IMPORTANCE_POWER`): it waits for that norm's tensor.
    head = _head_path(config)
    held_head, final_norm = None, None
    # Stacked expert weights fill up on the host, one expert per tensor, and go to the
    # device whole: {path: (host buffer, experts still missing)}.
    stacking: dict[tuple, tuple[np.ndarray, set[int]]] = {}
    fp8_stacking: dict[tuple, tuple[np.ndarray, np.ndarray, set[int]]] = {}
    np_dtype = np.dtype(jnp.dtype(dtype))
    targets = ((n, t, target) for n, t in tensors for target in hf_to_path(n, config))
    for name, tensor, (path, transform, index) in targets:
        if path not in expected:
            raise ValueError(f"tensor {name!r} has no place in the model (path {path})")
        var = expected[path]
        if path in filled:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        if name == "model.norm.weight":
            final_norm = _to_numpy(tensor).astype(np.float32) + config.norm_offset
        if index is None and path == head and quantization == "int4":
            held_head = (name, tensor, path, var)
            continue
        if isinstance(tensor, MXFP4Experts):  # kept 4-bit (loaders/mxfp4.py)
            w = dataclasses.replace(transform(tensor), dtype=np.dtype(dtype))
            if w.shape != var.shape:
                raise ValueError(
                    f"tensor {name!r}: MXFP4 experts of shape {w.shape} do not match the "
                    f"model's {var.shape} (from the config)"
                )
            filled[path] = var.replace(place_quantized(path, w))
            continue
        if index is None:
            w = _quantized(name, tensor, path, var, config, quantization, dtype)
            if w is not None:
                filled[path] = var.replace(place_quantized(path, w))
                continue
        elif keep_fp8_experts and isinstance(tensor, QArray) and tensor.fmt == "fp8":
            experts = _stack_fp8(name, tensor, index, path, var, fp8_stacking, dtype)
            if experts is not None:
                filled[path] = var.replace(place_quantized(path, experts))
            continue
        value = transform(_to_numpy(tensor))
        shape = var.shape if index is None else var.shape[1:]
        if value.shape != shape:
            raise ValueError(
                f"tensor {name!r}: shape {value.shape} after conversion does not match the "
                f"model's {shape} (from the config)"
            )
        if index is not None:
            buffer, todo = stacking.setdefault(
                path, (np.empty(var.shape, np_dtype), set(range(var.shape[0])))
            )
            if index not in todo:
                raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
            buffer[index] = value
            todo.discard(index)
            if todo:
                continue
            value = stacking.pop(path)[0]
        filled[path] = var.replace(place(path, value))
    if held_head is not None:
        name, tensor, path, var = held_head
        importance = None if final_norm is None else np.abs(final_norm) ** HEAD_IMPORTANCE_POWER
        w = _quantized(name, tensor, path, var, config, quantization, dtype, importance, head=True)
        filled[path] = var.replace(place_quantized(path, w))
    missing = [".".join(map(str, p)) for p in expected if p not in filled]
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} parameter(s), e.g. {', '.join(missing[:5])}"
        )
    return nnx.from_flat_state([(p, filled[p]) for p in expected])
