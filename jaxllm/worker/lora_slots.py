"""The LoRA adapters resident on the device: `max_loras` slots per target projection and
layer, as `jaxllm.models.lora` reads them (A [in, S, R], B [S, R, out], ranks padded to
`max_lora_rank` with zeros), in the model's dtype.

The slots keep a host copy; putting an adapter in a slot rewrites that copy and replaces the
device arrays of its targets with fresh ones of the same shapes and shardings (a step still
in flight keeps the arrays it was given): no program changes. Under tensor parallelism the
matrices split with their base weights: B on its output columns for q, k, v, gate and up, A
on its input rows for o and down (their partial products are summed like the base ones).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm import sharding
from jaxllm.config import LoRAConfig, ModelConfig
from jaxllm.lora import TARGETS, BaseDims, LoRAAdapter
from jaxllm.worker.device_state import DeviceState

_ROW_SPLIT = ("o_proj", "down_proj")  # the targets whose input side is split over devices


def _slot_shapes(config: ModelConfig, slots: int, rank: int) -> dict[str, tuple[tuple, tuple]]:
    """Per target, one layer's A [in, S, R] and B [S, R, out] shapes, kv heads repeated as
    the base weights' are (see sharding.py). `config`: the model's as sharded."""
    dims, shapes = BaseDims.of(config), {}
    for t in TARGETS:
        num_in, num_out = dims.shape(t)
        if t in ("k_proj", "v_proj"):
            num_out *= config.kv_head_replicas
        shapes[t] = (num_in, slots, rank), (slots, rank, num_out)
    return shapes


def lora_slot_bytes(config: ModelConfig, lora: LoRAConfig, itemsize: int, shards: int = 1) -> int:
    """The device memory the slots take on one device (the KV pool is sized after it): A and
    B of every target and layer, split over `shards` devices as `LoRASlots` places them; 0
    when LoRA is off. `config`: the model's as sharded."""
    if not lora.enable_lora:
        return 0
    total = 0
    for t, (a, b) in _slot_shapes(config, lora.max_loras, lora.max_lora_rank).items():
        a, b = int(np.prod(a)), int(np.prod(b))
        total += (a // shards + b) if t in _ROW_SPLIT else (a + b // shards)
    return total * config.num_layers * itemsize


class LoRASlots:
    def __init__(
        self,
        config: ModelConfig,
        device: DeviceState,
        *,
        max_loras: int,
        max_rank: int,
        dtype,
        mesh: Mesh | None,
    ):
        """`config`: the model's as sharded (kv heads repeated under tensor parallelism);
        `device`: where the runner's programs run (an abstract one's slots are abstract: a
        target's programs are compiled with them, see `jaxllm.aot`)."""
        self.num_slots, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.abstract = device.abstract
        self.config = config
        n = config.num_layers
        self.host: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.shardings: dict[str, tuple] = {}
        for t, (a, b) in _slot_shapes(config, max_loras, max_rank).items():
            self.host[t] = (np.zeros((n, *a), np.float32), np.zeros((n, *b), np.float32))
            if mesh is None:
                self.shardings[t] = (device.replicated, device.replicated)
            elif t in _ROW_SPLIT:
                split = NamedSharding(mesh, PartitionSpec("model", None, None))
                self.shardings[t] = (split, sharding.replicated(mesh))
            else:
                split = NamedSharding(mesh, PartitionSpec(None, None, "model"))
                self.shardings[t] = (sharding.replicated(mesh), split)
        self._slot_targets: list[set[str]] = [set() for _ in range(max_loras)]
        self.device = {t: self._upload(t) for t in TARGETS}

    def _upload(self, target: str) -> tuple[list[jax.Array], list[jax.Array]]:
        """The target's A and B of every layer, as device arrays (abstract ones when the
        runner is)."""
        pairs = zip(self.host[target], self.shardings[target], strict=True)
        if self.abstract:
            return tuple(
                [jax.ShapeDtypeStruct(h.shape[1:], self.dtype, sharding=sh)] * len(h)
                for h, sh in pairs
            )
        return tuple(
            [jax.device_put(layer.astype(self.dtype), sh) for layer in h] for h, sh in pairs
        )

    def set(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts `adapter` in `slot` (whatever was there is gone)."""
        targets = {t for _, t in adapter.weights}
        touched = targets | self._slot_targets[slot]
        for t in touched:
            a, b = self.host[t]
            a[:, :, slot] = 0
            b[:, slot] = 0
        replicas, h = self.config.kv_head_replicas, self.config.head_dim
        for (layer, t), (a, b) in adapter.weights.items():
            rank = a.shape[1]
            if t in ("k_proj", "v_proj") and replicas > 1:  # each kv head repeated
                b = np.repeat(b.reshape(rank, -1, h), replicas, axis=1).reshape(rank, -1)
            self.host[t][0][layer, :, slot, :rank] = a
            self.host[t][1][layer, slot, :rank] = b
        for t in touched:
            self.device[t] = self._upload(t)
        self._slot_targets[slot] = targets
