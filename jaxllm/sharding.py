"""Tensor parallelism on a `jax.sharding` mesh with axes ("data", "model").

Every parameter declares logical axes where it is created (`layers.param(..., axes=...)`);
`RULES` maps them to mesh axes, in one table:
- q/k/v projections are column-parallel (their head axis on "model"), o and down are
  row-parallel (their head / mlp input axis on "model"), gate and up are column-parallel on
  "mlp"; XLA inserts the one all-reduce after each row-parallel matmul;
- the embedding and the output head are split on the vocabulary;
- mixture-of-experts weights `[E, D, F]` are split on the expert axis (expert parallelism), or
  on each expert's MLP width when the mesh does not divide E (moe.py);
- a Gated DeltaNet layer's channels are split by key head group (each device runs the
  recurrence of its own heads, with their share of the state), its output projection is
  row-parallel;
- norms (and anything else) are replicated.
An axis whose length the mesh axis does not divide stays replicated (a 403-token toy
vocabulary, say); when two axes of one array map to the same mesh axis, the first that
divides takes it and the others stay whole.

The KV cache `[L, pages, K, page_size, 2H]` is split on its kv head axis, so each device holds
whole heads (keys and values) and attention runs per device on its own heads under
`shard_map`. With fewer kv heads than devices, each checkpoint kv head is repeated at load
time (`ModelConfig.kv_head_replicas`) so that every device holds whole heads: cheaper than
repeating activations every step.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import ModelConfig
from pallas_kernels.kv_cache import KVCache

logger = logging.getLogger(__name__)

RULES: dict[str, str | None] = {
    "vocab": "model",
    "embed": None,
    "q_heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "expert": "model",
    "expert_mlp": "model",
    "linear_heads": "model",  # a Gated DeltaNet layer's channels, by key head group
}


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data x tensor devices."""
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} x data_parallel_size "
            f"{data_parallel_size} needs {needed} devices; {len(devices)} available"
        )
    grid = np.asarray(devices[:needed]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of an array with these logical axes. Arrays stacked over layers
    carry one more (leading) dimension than their axes name: it stays unsplit."""
    axes = (None,) * (len(shape) - len(axes)) + tuple(axes)
    spec, used = [], set()
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(name) if name is not None else None
        if mesh_axis in used or (mesh_axis is not None and size % mesh.shape[mesh_axis]):
            mesh_axis = None  # taken, or not evenly divisible: keep this dimension whole
        if mesh_axis is not None:
            used.add(mesh_axis)
        spec.append(mesh_axis)
    return P(*spec)


def param_shardings(abstract_state, mesh: Mesh) -> dict[tuple, NamedSharding]:
    """{parameter path: NamedSharding} for an abstract NNX state, from each `axes`."""
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(abstract_state):
        axes = var.get_metadata().get("axes", ())
        out[path] = NamedSharding(mesh, spec_for(tuple(axes), var.shape, mesh))
    return out


def kv_cache_specs(quantized: bool) -> KVCache:
    """The paged cache `[L, pages, K, page_size, 2H]` split on its kv heads (each device holds
    whole heads, keys and values); an 8-bit cache's scales `[L, pages, 1, 2K * page_size]` on
    their head-major lanes, which splits them with their heads."""
    data = P(None, None, "model", None, None)
    return KVCache(data, P(None, None, None, "model") if quantized else None)


def kv_cache_sharding(mesh: Mesh, quantized: bool = False) -> KVCache:
    data, scales = kv_cache_specs(quantized)
    return KVCache(
        NamedSharding(mesh, data), None if scales is None else NamedSharding(mesh, scales)
    )


def kv_cache_placement(mesh: Mesh | None, dtype, device: jax.Device | None = None) -> KVCache:
    """The shardings of a KV cache of `dtype`: split over `mesh` on kv heads, or whole on
    `device` (default: the first local device) without a mesh."""
    from pallas_kernels import is_quantized_dtype

    if mesh is not None:
        return kv_cache_sharding(mesh, is_quantized_dtype(dtype))
    single = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
    return KVCache(single, single)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config the sharded model is built with: kv heads repeated so that every device
    holds whole heads when there are fewer than devices. Raises, naming the parameter, when
    the heads cannot be split evenly."""
    tp = tensor_parallel_size
    if tp == 1:
        return config
    n, k = config.num_heads, config.num_kv_heads
    la = config.linear_attention
    if la is not None and la.num_key_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's {la.num_key_heads} "
            f"linear-attention key heads (linear_num_key_heads); use a divisor of it"
        )
    if n % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's {n} query heads; use a "
            f"divisor of {n}"
        )
    if config.heads_vary_by_layer:  # (Gemma 4): their packed rows split whole
        return _shard_mixed(config, tp)
    if k % tp == 0:
        return config
    if tp % k:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {k} kv heads do not divide one another"
        )
    replicas = tp // k
    logger.info("tensor parallel %d > %d kv heads: each kv head is repeated %dx", tp, k, replicas)
    return dataclasses.replace(
        config, num_kv_heads=k * replicas, kv_head_replicas=config.kv_head_replicas * replicas
    )


def _shard_mixed(config: ModelConfig, tp: int) -> ModelConfig:
    """A model whose layers differ in head width or kv heads (Gemma 4): every device must hold
    whole rows of every cache slot (`jaxllm.models.kv_layout`), so the slot's kv heads must
    split over the devices. When they do not, every layer's kv heads are repeated the fewest
    times that makes them (the 26B-A4B's full layers have 2 kv heads: 4 chips repeat each
    twice, and its sliding layers' 8 too)."""
    for r in range(1, tp + 1):
        if tp % r:
            continue
        try:  # (refused once a layer's kv heads no longer divide its query heads)
            c = dataclasses.replace(
                config,
                num_kv_heads=config.num_kv_heads * r,
                kv_head_replicas=config.kv_head_replicas * r,
            )
        except ValueError:
            break
        if c.cache_kv_heads % tp == 0:
            if r > 1:
                logger.info("tensor parallel %d: each kv head is repeated %dx", tp, r)
            return c
    raise ValueError(
        f"tensor_parallel_size {tp} cannot split this model's cache rows ({config.cache_kv_heads}"
        " kv heads a slot, its layers differing in head width or kv heads: see "
        "jaxllm.models.kv_layout) over the devices, even with its kv heads repeated; use a "
        "divisor of it"
    )


def per_device_bytes(arrays) -> tuple[int, int]:
    """(bytes on the busiest device, bytes of the whole arrays) over a pytree of jax.Arrays."""
    per_device: dict = {}
    total = 0
    for a in jax.tree.leaves(arrays):
        total += a.size * a.dtype.itemsize
        for shard in a.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0), total
