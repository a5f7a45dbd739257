"""The engine `jaxllm serve` would build on a target, from the model's config alone, with every
program compiled by the target's own compiler on this machine.

The weights are abstract (shapes, dtypes and shardings on the target's compile-only devices),
so a 70B model is checked on a laptop: the model is built with `nnx.eval_shape`, quantized
weights take the shapes `quantize` would give them, the KV pool is sized as `serve` sizes it on
that chip (its memory, `memory_utilization`, the weights' bytes as the device lays them out,
and each page's bytes in the cache's compiled layout), and `ModelRunner.warmup` compiles every
program the engine compiles at startup, with the kernels traced for the target's platform.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

import pallas_kernels
from jaxllm import loaders
from jaxllm.aot.targets import Target
from jaxllm.config import CompilationConfig, EngineConfig, ModelConfig, resolve_dtype
from jaxllm.loaders import load_config, quantized_hf
from jaxllm.loaders.gguf import has_mxfp4
from jaxllm.loaders.weights import abstract_state_for
from jaxllm.model_files import resolve_model
from jaxllm.quantization import FORMATS
from jaxllm.sharding import make_mesh, param_shardings
from jaxllm.worker import (
    DeviceMemory,
    EnginePlan,
    ModelRunner,
    NoRoom,
    engine_bytes,
    page_layout,
    plan_engine,
)

logger = logging.getLogger(__name__)


class DoesNotFit(ValueError):
    """The model, at these settings, does not fit the target; the message says what would."""


@dataclasses.dataclass
class AbstractModel:
    config: ModelConfig  # as sharded (kv heads repeated under tensor parallelism)
    model: nnx.Module  # with abstract parameters on the target's devices
    weight_bytes: int  # per device, logical
    weight_device_bytes: int | None  # per device, as laid out; None: over the device's memory
    expert_bytes: int = 0  # of weight_bytes, the experts' (which quantization leaves float)
    # A head's `Eagle3Config` or `MTPConfig` (`config` is then its layer's, whose KV shares the
    # pages)
    proposer_config: Any = None


@dataclasses.dataclass
class CompiledEngine:
    target: Target
    plan: EnginePlan  # as `serve` would plan it on the target
    model_config: ModelConfig
    dtype: jnp.dtype  # the weights'
    runner: ModelRunner  # abstract: its `programs` hold what the compiler said of each
    weights: list[AbstractModel]  # the model, then the draft model if any
    compile_seconds: float
    build_seconds: float

    @property
    def config(self) -> EngineConfig:
        """Resolved: max_model_len, num_pages, tensor_parallel_size filled in."""
        return self.plan.config

    @property
    def kv_dtype(self) -> jnp.dtype:
        return self.plan.kv_dtype

    @property
    def page_bytes(self) -> int:
        """One page of every layer (both caches with a draft) on one device."""
        return self.plan.page_bytes

    @property
    def budget_bytes(self) -> int | None:
        """What the KV pool could take on one device (None: num_pages was given)."""
        return self.plan.budget_bytes

    @property
    def weight_device_bytes(self) -> int:
        return sum(w.weight_device_bytes for w in self.weights)

    @property
    def weight_bytes(self) -> int:
        return sum(w.weight_bytes for w in self.weights)

    @property
    def kv_cache_device_bytes(self) -> int:
        return self.runner.num_pages * self.page_bytes

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.parallel.tensor_parallel_size or 1


def compile_engine(
    config: EngineConfig,
    target: Target,
    *,
    progress: bool = True,
    decode_only: bool = False,
    keep_executables: bool = False,
) -> CompiledEngine:
    """Builds the engine on `target` from `config` and compiles all its programs (with
    `decode_only`, those of decode steps; `keep_executables` keeps the executables for
    `save_executables`). Raises `DoesNotFit` (a ValueError) when the weights or
    `max_model_len` do not fit."""
    start = time.perf_counter()
    devices = target.devices()
    platform = devices[0].platform  # "tpu" or "gpu"
    tp = config.parallel.tensor_parallel_size or target.num_devices
    if tp > target.num_devices:
        raise ValueError(
            f"tensor_parallel_size {tp} needs {tp} devices; {target.name} has {target.num_devices}"
        )
    mesh = make_mesh(tp, devices=devices) if tp > 1 else None
    dtype = resolve_dtype(config.load.dtype, platform)
    # The kernel choices, resolved for the target's platform, travel in the config from here.
    config = config.replace(
        attention_backend=pallas_kernels.resolve_backend(
            config.compilation.attention_backend, platform
        )
    )
    comp = config.compilation
    quantization = config.load.quantization
    memory = target.limit_bytes(config.cache.memory_utilization)
    model = abstract_model(config.load.model, dtype, comp, mesh, devices[0], quantization, memory)
    vision = abstract_vision(
        config.load.model, dtype, mesh, devices[0], config.multimodal.mm_processor_kwargs
    )
    if vision is not None:  # its weights come out of the KV pool's budget like the decoder's
        model.weight_bytes += vision.weight_bytes
        if model.weight_device_bytes is not None:
            model.weight_device_bytes += vision.weight_device_bytes
    weights = [model]
    spec = config.speculative.method
    if spec is not None and spec.method == "draft_model":
        weights.append(abstract_model(spec.model, dtype, comp, mesh, devices[0], None, memory))
    elif spec is not None and spec.method == "eagle3":
        weights.append(abstract_eagle3(spec.model, model.config, dtype, comp, mesh, devices[0]))
    elif spec is not None and spec.method == "mtp":
        mtp = spec.model or config.load.model
        weights.append(abstract_mtp(mtp, model.config, dtype, comp, mesh, devices[0], quantization))
    if any(w.weight_device_bytes is None for w in weights):
        logical = sum(w.weight_bytes for w in weights)
        page_bytes = _page_bytes(config, model.config, weights, mesh, devices[0])
        raise DoesNotFit(
            f"{config.load.model} does not fit {target.name}: its weights take "
            f"{_gib(logical)} per device, "
            + ("more than" if logical > memory else "and more as the chip lays them out than")
            + f" the {_gib(memory)} of the chip. "
            + fit_advice(
                config, target, dtype, logical, page_bytes, sum(w.expert_bytes for w in weights)
            )
        )
    weight_device_bytes = sum(w.weight_device_bytes for w in weights)
    usable = engine_bytes(target.platform, memory, config.cache.memory_utilization)
    try:  # as `serve` plans it on the target, with the weights laid out as it lays them
        plan = plan_engine(
            config.replace(tensor_parallel_size=tp),
            model.config,
            DeviceMemory(usable, weight_device_bytes),
            dtype=dtype,
            mesh=mesh,
            device=devices[0],
            draft_config=weights[1].config if len(weights) > 1 else None,
            vision=None if vision is None else vision.model.config,
        )
    except NoRoom as e:
        page_bytes = _page_bytes(config, model.config, weights, mesh, devices[0])
        raise DoesNotFit(
            f"{config.load.model} does not fit {target.name}: {e}. "
            + fit_advice(
                config,
                target,
                dtype,
                weight_device_bytes,
                page_bytes,
                sum(w.expert_bytes for w in weights),
            )
        ) from e
    runner = ModelRunner(
        model.model,
        model.config,
        plan,
        mesh=mesh,
        draft_model=None
        if len(weights) == 1
        else (weights[1].model, weights[1].proposer_config or weights[1].config),
        vision=None if vision is None else vision.model,
    )
    build_seconds = time.perf_counter() - start
    runner.compiler.keep_executables = keep_executables
    compile_seconds = runner.warmup(
        progress=progress, check_in_place=False, decode_only=decode_only
    )
    return CompiledEngine(
        target, plan, model.config, dtype, runner, weights, compile_seconds, build_seconds
    )


def _page_bytes(config, model_config, weights, mesh, device) -> int:
    """One page's bytes on one device, for the advice of a model that does not fit (where no
    plan could be made), as the plan counts them."""
    tp = config.parallel.tensor_parallel_size or (1 if mesh is None else mesh.size)
    config = config.replace(tensor_parallel_size=tp)
    draft = weights[1].config if len(weights) > 1 else None
    return page_layout(config, model_config, draft, mesh, device)[2]


def abstract_model(
    model: str,
    dtype,
    compilation: CompilationConfig,
    mesh,
    device: jax.Device,
    quantization: str | None = None,
    memory_bytes: int | None = None,
) -> AbstractModel:
    """The model at `model` (a directory whose config.json is all that is read, a .gguf file's
    metadata, or a demo name) built with abstract parameters placed on `mesh`, or on `device`
    without one. Its `weight_device_bytes` are None where the weights exceed `memory_bytes`
    (a device's) as the target lays them out."""
    path = resolve_model(model)
    if path.suffix == ".gguf" and quantization not in ("float", *FORMATS):
        raise ValueError(
            f"{path.name}: a GGUF file's own quantized tensors are not compiled here; compile "
            "it with --quantization float, int8, int4 or fp8"
        )
    config = load_config(path)
    config, graphdef, abstract_state = loaders.abstract_model(config, dtype, compilation, mesh)
    shardings = _placements(abstract_state, mesh, device)
    state = _as_served(path, abstract_state, config, dtype, shardings, quantization)
    leaves = jax.tree.leaves(state)
    logical = sum(_shard_bytes(a) for a in leaves)
    experts = sum(
        _shard_bytes(a)
        for _, v in nnx.to_flat_state(state)
        if "expert" in v.get_metadata().get("axes", ())
        for a in jax.tree.leaves(v.get_value())
    )
    device_bytes = None if memory_bytes and logical > memory_bytes else _device_bytes(leaves)
    return AbstractModel(config, nnx.merge(graphdef, state), logical, device_bytes, experts)


def _as_served(path, abstract_state, config: ModelConfig, dtype, shardings, quantization):
    """`abstract_state` of a model of checkpoint `path` as serving lays it out: MXFP4 experts
    kept 4-bit; a fine-grained FP8 checkpoint's layers kept fp8 (compiled as per-channel fp8,
    whose bytes are within a few percent of its blocks') and its experts kept so on
    accelerators; else as `quantization` says."""
    hf = _hf_config(path) if path.is_dir() else {}
    method = quantized_hf.checkpoint_method(hf) if path.is_dir() else None
    if method is not None and method not in ("mxfp4", "fp8"):
        raise ValueError(
            f"{path}: a {method} checkpoint's tensors are not compiled here; compile the float "
            "model, with --quantization int8, int4 or fp8 if wanted"
        )
    fp8_group = None  # experts not kept fp8
    if method == "fp8" and loaders.fp8_experts_kept(quantization, on_cpu=False):
        block = (hf.get("quantization_config") or {}).get("weight_block_size")
        fp8_group = block[1] if block else 0  # 0: one factor a row
    if method == "fp8" and quantization is None:
        quantization = "fp8"
    # MXFP4 experts (a gpt-oss checkpoint's, or a GGUF file's) kept 4-bit, as served.
    shipped = method == "mxfp4" or (path.suffix == ".gguf" and has_mxfp4(path))
    mxfp4 = shipped and loaders.mxfp4_kept(quantization, on_cpu=False)
    if quantization == "mxfp4":
        quantization = None  # the rest of the checkpoint is float
    return abstract_state_for(
        abstract_state,
        config,
        dtype,
        shardings,
        quantization,
        mxfp4_experts=mxfp4,
        fp8_experts=fp8_group,
        float_embeddings=method == "fp8",
    )


def abstract_vision(
    model: str, dtype, mesh, device: jax.Device, processor_kwargs: dict | None = None
) -> AbstractModel | None:
    """An image-text model's vision encoder with abstract parameters placed as `abstract_model`
    places the decoder's (None for a text model; `processor_kwargs`: --mm-processor-kwargs)."""
    from jaxllm.loaders.vision import encoder_class, vision_config

    config = vision_config(resolve_model(model), processor_kwargs)
    if config is None:
        return None
    module = encoder_class(config)
    abstract = nnx.eval_shape(lambda: module(config, dtype=dtype, rngs=None))
    encoder, logical, device_bytes = _placed(*nnx.split(abstract), mesh, device)
    return AbstractModel(None, encoder, logical, device_bytes)


def abstract_eagle3(
    model: str, target: ModelConfig, dtype, compilation: CompilationConfig, mesh, device
) -> AbstractModel:
    """An EAGLE-3 head (its config.json is all that is read) with abstract parameters placed
    as `abstract_model` places the target's."""
    from jaxllm.loaders.eagle3 import abstract_head, load_eagle3_config

    config = load_eagle3_config(resolve_model(model), target, weights=False)
    config, graphdef, state = abstract_head(config, dtype, compilation, mesh)
    head, logical, device_bytes = _placed(graphdef, state, mesh, device)
    return AbstractModel(config.layer, head, logical, device_bytes, proposer_config=config)


def abstract_mtp(
    model: str,
    target: ModelConfig,
    dtype,
    compilation: CompilationConfig,
    mesh,
    device,
    quantization: str | None = None,
) -> AbstractModel:
    """A checkpoint's MTP layer (its config.json is all that is read) with abstract
    parameters placed as `abstract_model` places the target's."""
    from jaxllm.loaders.mtp import abstract_head, load_mtp_config

    path = resolve_model(model)
    config = load_mtp_config(path, target)
    graphdef, state = abstract_head(config, dtype, compilation, mesh)
    # Its layer as the target's are laid out (an FP8 checkpoint's experts kept fp8); its
    # own tensors float, as `loaders.mtp` reads them.
    shardings = _placements(state, mesh, device)
    layer = nnx.State({"layers": state["layers"]})
    layer = _as_served(path, layer, config.layer, dtype, shardings, quantization)
    flat = dict(nnx.to_flat_state(layer))
    flat |= {
        path: var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[path]))
        for path, var in nnx.to_flat_state(state)
        if path not in flat
    }
    state = nnx.from_flat_state(list(flat.items()))
    leaves = jax.tree.leaves(state)
    logical = sum(_shard_bytes(a) for a in leaves)
    head = nnx.merge(graphdef, state)
    return AbstractModel(config.layer, head, logical, _device_bytes(leaves) or logical,
                         proposer_config=config)  # fmt: skip


def _placed(graphdef, state, mesh, device) -> tuple[nnx.Module, int, int]:
    """A module of abstract parameters placed on `mesh` or `device` (see `_placements`),
    with its bytes on one device: logical, and as the target lays them out."""
    shardings = _placements(state, mesh, device)
    flat = [
        (path, var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[path])))
        for path, var in nnx.to_flat_state(state)
    ]
    state = nnx.from_flat_state(flat)
    leaves = jax.tree.leaves(state)
    logical = sum(_shard_bytes(a) for a in leaves)
    return nnx.merge(graphdef, state), logical, _device_bytes(leaves) or logical


def _placements(abstract_state, mesh, device: jax.Device) -> dict:
    """{parameter path: sharding}: on `mesh` as their logical axes say, or all on `device`."""
    if mesh is not None:
        return param_shardings(abstract_state, mesh)
    single = SingleDeviceSharding(device)
    return {path: single for path, _ in nnx.to_flat_state(abstract_state)}


def _hf_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    """Bytes of the busiest device's shard of `a`."""
    shape = a.sharding.shard_shape(a.shape)
    size = 1
    for d in shape:
        size *= d
    return size * jnp.dtype(a.dtype).itemsize


def _device_bytes(leaves: list[jax.ShapeDtypeStruct]) -> int | None:
    """Bytes the parameters take on one device in the target's layouts: the output size of a
    compiled program that creates them (a TPU pads the two minor dimensions to its tiles);
    None where the compiler finds that they exceed the device's memory."""
    make = jax.jit(
        lambda: [jnp.zeros(a.shape, a.dtype) for a in leaves],
        out_shardings=[a.sharding for a in leaves],
    )
    try:
        return make.lower().compile().memory_analysis().output_size_in_bytes
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None


def fit_advice(
    config: EngineConfig,
    target: Target,
    dtype,
    weight_bytes: int,
    page_bytes: int,
    expert_bytes: int = 0,
) -> str:
    """What would fit, naming the flags: more devices (tensor parallelism), smaller weights
    (quantization, which leaves the `expert_bytes` of a mixture of experts float), a shorter
    context."""
    util = config.cache.memory_utilization
    usable = engine_bytes(target.platform, target.limit_bytes(util), util)
    tp = config.parallel.tensor_parallel_size or target.num_devices
    chip = target.chip
    # Smaller weights: (flag, bytes per device) for each format that shrinks these.
    formats = [("", weight_bytes)]
    if config.load.quantization in (None, "float"):
        linear = jnp.dtype(dtype).itemsize
        for fmt, bits in (("int8", 8), ("int4", 5)):  # int4: 4 bits and a scale per 32
            shrunk = (weight_bytes - expert_bytes) * bits / (8 * linear) + expert_bytes
            if shrunk < weight_bytes:
                formats.append((f"--quantization {fmt}", shrunk))
    more = [n for n in chip.counts if n > tp]

    def tip(n: int, flag: str, per_device: float) -> str | None:
        """The flags for `n` devices and weights of `per_device` bytes at `tp`, if they fit."""
        per_device = per_device * tp / n
        if per_device >= 0.8 * usable:
            return None
        flags = " ".join(filter(None, [f"--target {chip.target_name(n)}" if n > tp else "", flag]))
        parallel = f"tensor parallelism {n}: " if n > tp else ""
        return f"{flags} ({parallel}~{_gib(per_device)} of weights per device)"

    # More devices (the fewest that hold it), smaller weights, and only where neither alone
    # does, both.
    first = [
        next(filter(None, (tip(n, *formats[0]) for n in more)), None),
        next(filter(None, (tip(tp, *f) for f in formats[1:])), None),
    ]
    tips = [t for t in first if t]
    if not tips:
        both = (tip(n, *f) for n in more for f in formats[1:])
        tips = [t for t in [next(filter(None, both), None)] if t]
    free = usable - weight_bytes
    if free > 2 * page_bytes:
        tokens = int(free // page_bytes) * config.cache.page_size
        tips.append(f"--max-model-len {tokens} (the longest context this pool holds)")
        if config.cache.kv_cache_dtype in ("auto", "bfloat16", "float32", "float16"):
            tips.append("--kv-cache-dtype int8 (about half the bytes per token)")
    if not tips:
        return "Nothing on this target holds it: use a larger chip or more of them."
    return "What would fit: " + "; or ".join(tips) + "."


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def save_executables(engine: CompiledEngine, directory: str) -> int:
    """Serializes every compiled executable (`jax.experimental.serialize_executable`) into
    `directory`, one file per program, with a manifest naming the target, the model and the
    versions that must match where they are loaded. Loading needs the target's runtime (a TPU
    VM): it is not verified here."""
    import pickle
    from pathlib import Path

    from jax.experimental import serialize_executable

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "target": engine.target.name,
        "device_kind": engine.target.chip.device_kind,
        "model": engine.config.load.model,
        "config": {k: v for k, v in engine.config.flat().items() if _plain(v)},
        "jax": jax.__version__,
        "programs": [],
    }
    for (name, shape), compiled in sorted(engine.runner.compiler.executables.items()):
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        file = f"{name}-{'x'.join(map(str, shape))}.xla"
        (out / file).write_bytes(pickle.dumps((payload, in_tree, out_tree)))
        manifest["programs"].append({"name": name, "shape": list(shape), "file": file})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return len(manifest["programs"])


def _plain(value) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
