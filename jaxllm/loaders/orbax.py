"""Converted checkpoints in orbax-checkpoint's format: written once from a Hugging Face directory
or a GGUF file (`jaxllm convert SRC DST`), restored straight into the serving layout.

A converted checkpoint is a directory:

    DST/state/               the parameters, one orbax (tensorstore/OCDBT) array per parameter
    DST/config.json          the Hugging Face style config the model came from (`load_hf_config`)
    DST/tokenizer*.json ...  the tokenizer (`save_pretrained`), with its chat template
    DST/generation_config.json   when the source had one
    DST/jaxllm_orbax.json    the marker: format version, dtype, source

The parameters are stored in our own layout (einsum-shaped, one array per parameter of each
decoder layer, keyed "layers/<i>/..."), so restoring is a read and nothing else: no renaming, transposing, un-permuting or
dequantizing. They are stored with the checkpoint's own kv heads (no tensor-parallel
repetition), so one checkpoint serves every tensor-parallel size. Storage chunks are one layer
and one head at a time (other axes split to about 1 MiB), so a device restoring its shard reads
little more than its shard.

Restoring: every parameter is read with the sharding the mesh gives it (`param_shardings`), so
each device reads and receives only its slice (without a mesh, parameters are read to the host
and placed the way the other loaders place them). The exception is tensor parallelism over more
devices than kv heads (`ModelConfig.kv_head_replicas` r > 1): the k/v projections (and
biases) are read whole onto every device, in the checkpoint's K heads, and one jitted
`jnp.repeat` with the target `out_shardings` makes the K*r heads, each device computing only
its own. Those are a small share of the weights (K/N of the attention projections; for
Llama-3-70B in bf16, 1.3 GiB each for k and v, briefly on every device), and the whole copy is
dropped as soon as the repeated one exists.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.loaders.loaded import LoadedModel
from jaxllm.loaders.weights import param_dtype
from jaxllm.quantization import QArray

logger = logging.getLogger(__name__)

MARKER = "jaxllm_orbax.json"
FORMAT = "jaxllm-orbax"
VERSION = 3  # 3: 2-D attention projections; 2: [D, N, H] ones; 1: layers stacked on one axis
STATE_DIR = "state"
CHUNK_BYTES = 1 << 20  # storage chunks of at most 1 MiB (besides one layer, one head)
COMPRESS = False  # zstd: a third smaller only for dequantized GGUF weights, slower to read
_HEAD_AXES = ("q_heads", "kv_heads")


def is_orbax_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def read_marker(path: Path) -> dict:
    marker = json.loads((path / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER} is not a {FORMAT} marker")
    if marker.get("version", 0) > VERSION:
        raise ValueError(
            f"{path} was written by a newer jaxllm (format version {marker['version']}, this "
            f"one reads up to {VERSION})"
        )
    if marker.get("version", 0) < VERSION:
        raise ValueError(
            f"{path} is in an older format (version {marker.get('version')}, whose parameter "
            f"shapes this one no longer has); convert its source again with `jaxllm convert`"
        )
    return marker


def source_hf_config(path: Path) -> dict:
    """The Hugging Face `config.json` dict of a source model (GGUF metadata converted)."""
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return json.loads(config_file.read_text())
    if path.suffix == ".gguf":
        from jaxllm.loaders.gguf import gguf_hf_config
        from jaxllm.loaders.gguf_file import GGUFFile

        reader = GGUFFile(path)
        config = gguf_hf_config(reader)
        # For transformers' Auto* classes; our three GGUF architectures share HF's names.
        config["model_type"] = reader.field("general.architecture")
        return config
    raise ValueError(
        f"model path {path} is neither a Hugging Face checkpoint directory nor a .gguf file"
    )


def _kv_axis(var: nnx.Variable) -> int | None:
    """The index of the kv-head axis of a parameter."""
    axes = tuple(var.get_metadata().get("axes", ()))
    if "kv_heads" not in axes:
        return None
    return axes.index("kv_heads")


def _head_dim(config: ModelConfig, path: tuple) -> int:
    """The head width of the layer a parameter's path is in (Gemma 4's differ)."""
    if len(path) > 1 and path[0] == "layers":
        return config.layer_head_dim(int(path[1]))
    return config.head_dim


def _repeat_heads(x: jax.Array, r: int, axis: int, head_dim: int) -> jax.Array:
    """Each head of the `axis` of `x` (kv heads x head_dim, fused) repeated r times."""
    split = x.shape[:axis] + (x.shape[axis] // head_dim, head_dim) + x.shape[axis + 1 :]
    return jnp.repeat(x.reshape(split), r, axis=axis).reshape(
        x.shape[:axis] + (x.shape[axis] * r,) + x.shape[axis + 1 :]
    )


def _first_of_each_repeat(x: jax.Array, r: int, axis: int, head_dim: int) -> jax.Array:
    """The inverse of `_repeat_heads`: every r-th head of the `axis` of `x`."""
    split = x.shape[:axis] + (x.shape[axis] // head_dim, head_dim) + x.shape[axis + 1 :]
    heads = jax.lax.slice_in_dim(x.reshape(split), 0, split[axis], r, axis=axis)
    return heads.reshape(x.shape[:axis] + (x.shape[axis] // r,) + x.shape[axis + 1 :])


def _save_args(var: nnx.Variable, shape: tuple[int, ...]):
    """Chunks of one head, else about CHUNK_BYTES: restoring one shard then reads about that
    shard whatever the tensor-parallel size."""
    import orbax.checkpoint as ocp

    if CHUNK_BYTES is None:
        return ocp.SaveArgs()
    axes = tuple(var.get_metadata().get("axes", ()))
    shard_axes = tuple(i for i, name in enumerate(axes) if name in _HEAD_AXES)
    return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=shard_axes)


def _key(path: tuple) -> tuple[str, ...]:
    """A parameter path as stored: layer indices become strings ("layers", "0", ...)."""
    return tuple(str(k) for k in path)


def _nest(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        path = _key(path)
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def save(
    model_or_state: Any,
    hf_config: dict,
    tokenizer: Any,
    generation_config: dict | None,
    dst: str | os.PathLike,
    *,
    kv_head_replicas: int | None = None,
    source: str | None = None,
) -> Path:
    """Writes a converted checkpoint to `dst` (which must not exist, or be empty).

    `model_or_state`: a `LoadedModel`, an NNX module or its state. Arrays may be sharded
    (orbax writes each shard from its device). A model loaded for tensor parallelism over more
    devices than kv heads holds each kv head `kv_head_replicas` times (taken from a
    `LoadedModel`'s config when not given): only one copy is stored. Everything is written to
    a temporary sibling first and renamed, so `dst` appears complete or not at all."""
    import orbax.checkpoint as ocp

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} already exists and is not an empty directory")
    if isinstance(model_or_state, LoadedModel):
        if kv_head_replicas is None:
            kv_head_replicas = model_or_state.config.kv_head_replicas
        model_or_state = model_or_state.model
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    r = kv_head_replicas or 1
    config = ModelConfig.from_hf_config(hf_config)  # refuses what would not load

    flat, args, dtypes = {}, {}, set()
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if isinstance(value, QArray):
            raise ValueError(
                f"parameter {'.'.join(map(str, path))} is quantized; converted checkpoints hold "
                "float weights (load the model with quantization='float' to save it)"
            )
        axis = _kv_axis(var)
        if r > 1 and axis is not None:
            value = _first_of_each_repeat(value, r, axis, _head_dim(config, path))
        flat[path] = value
        args[path] = _save_args(var, value.shape)
        dtypes.add(str(value.dtype))

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=COMPRESS))
        try:
            checkpointer.save(
                tmp / STATE_DIR, args=ocp.args.PyTreeSave(_nest(flat), save_args=_nest(args))
            )
        finally:
            checkpointer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if generation_config:
            (tmp / "generation_config.json").write_text(
                json.dumps(generation_config, indent=2) + "\n"
            )
        from jaxllm import __version__

        marker = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtypes.pop() if len(dtypes) == 1 else sorted(dtypes),
            "source": source,
            "num_parameters": int(sum(np.prod(v.shape) for v in flat.values())),
            "jaxllm_version": __version__,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def restore_state(
    path: Path,
    abstract_state: nnx.State,
    config: ModelConfig,
    dtype: jnp.dtype,
    shardings: dict[tuple, jax.sharding.NamedSharding] | None = None,
) -> nnx.State:
    """Reads the parameters of a converted checkpoint into `abstract_state`'s layout, in
    `dtype` (cast while reading), each with its sharding from `shardings`. See the module
    docstring for kv heads repeated for tensor parallelism.

    Without `shardings` the parameters are read to the host and placed with `jnp.asarray`,
    exactly as the other loaders place them: arrays committed to a device (what restoring
    to a `SingleDeviceSharding` gives) would not match the programs the runner compiles at
    warmup, and would compile again on the first batches."""
    import orbax.checkpoint as ocp

    read_marker(path)
    r = config.kv_head_replicas
    expected = dict(nnx.to_flat_state(abstract_state))
    state_dir = (path / STATE_DIR).absolute()
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        stored_tree = checkpointer.metadata(state_dir).item_metadata.tree
        stored = {
            tuple(str(p.key) for p in key): leaf
            for key, leaf in jax.tree_util.tree_flatten_with_path(stored_tree)[0]
        }
        missing = [".".join(_key(p)) for p in expected if _key(p) not in stored]
        extra = [".".join(p) for p in stored if p not in set(map(_key, expected))]
        if missing or extra:
            raise ValueError(
                f"checkpoint {path} does not match the model built from its config.json: "
                f"missing {missing[:5]}, unexpected {extra[:5]}"
            )
        targets, restore_args, repeats = {}, {}, {}
        for p, var in expected.items():
            shape = tuple(var.shape)
            axis = _kv_axis(var)
            sharding = None if shardings is None else shardings[p]
            if r > 1 and axis is not None:
                # Read the checkpoint's K heads whole on every device; repeated below.
                repeats[p] = (axis, sharding)
                shape = shape[:axis] + (shape[axis] // r,) + shape[axis + 1 :]
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            if tuple(stored[_key(p)].shape) != shape:
                raise ValueError(
                    f"checkpoint {path}: parameter {'.'.join(_key(p))} has shape "
                    f"{tuple(stored[_key(p)].shape)}, the model wants {shape} (from config.json)"
                )
            want = param_dtype(var, dtype)
            targets[p] = jax.ShapeDtypeStruct(shape, want, sharding=sharding)
            restore_args[p] = (
                ocp.RestoreArgs(restore_type=np.ndarray, dtype=want)
                if sharding is None
                else ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=want)
            )
        restored = checkpointer.restore(
            state_dir,
            args=ocp.args.PyTreeRestore(_nest(targets), restore_args=_nest(restore_args)),
        )
    finally:
        checkpointer.close()
    by_key = {
        tuple(str(k.key) for k in key): leaf
        for key, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
    }
    values = {p: by_key[_key(p)] for p in expected}
    for p, (axis, sharding) in repeats.items():
        whole, h = values[p], _head_dim(config, p)
        values[p] = jax.jit(
            lambda x, axis=axis, h=h: _repeat_heads(x, r, axis, h),
            out_shardings=sharding,
        )(whole)
        whole.delete()
    if shardings is None:
        values = {p: jnp.asarray(v) for p, v in values.items()}
    return nnx.from_flat_state([(p, var.replace(values[p])) for p, var in expected.items()])
