"""The engine plan: how one engine uses a device's memory and what it serves, worked out once
from the engine config, the model's config, the device and the weights' bytes.

`serve` (`EngineCore.from_config`, real weights on the local devices) and `jaxllm compile`
(`jaxllm.aot.compile_engine`, abstract weights on a target's) both call `plan_engine`, and
build their runner, KV cache manager and report from what it returns. Everything that takes
device memory besides the KV cache is one entry of `EnginePlan.memory` (`_consumers`): the
pool gets what `memory_utilization` leaves after them. The serving kind (generate, or pool a
decoder's hidden states; an encoder checkpoint has a core of its own) is decided here too
(`serving_kind`), for all callers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.classifier import ClassifierHead, read_classifier
from jaxllm.config import CacheConfig, EngineConfig, ModelConfig
from jaxllm.loaders.encoder import is_encoder
from jaxllm.model_files import resolve_model
from jaxllm.models.linear_attention import state_bytes_per_slot
from jaxllm.pooling import (
    DECODER_CLASSIFIER_POOLER,
    DECODER_POOLER,
    PoolerConfig,
    decoder_pools,
    has_lm_head,
    resolve_pooler_config,
)
from jaxllm.sharding import kv_cache_placement
from jaxllm.worker.kv_groups import KVCacheGroups, engine_kv_groups
from jaxllm.worker.kv_sizing import (
    DeviceMemory,
    device_page_bytes,
    plan_kv_cache,
    resolve_kv_cache_dtype,
)
from jaxllm.worker.lora_slots import lora_slot_bytes
from jaxllm.worker.mm_encoder import encoder_cache_bytes

if TYPE_CHECKING:
    from jaxllm.models.qwen_vision import QwenVisionConfig
    from jaxllm.models.vision import VisionConfig

logger = logging.getLogger(__name__)


class NoRoom(ValueError):
    """The device's memory, at these settings, holds no pool that fits a sequence (or not one
    of max_model_len); the message names the setting. `jaxllm compile` adds what would fit."""


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """One engine's plan (see the module's docstring). `config` is the engine config with
    what the plan resolved filled in (max_model_len, num_pages, tensor_parallel_size)."""

    config: EngineConfig
    kv_dtype: jnp.dtype
    kv_groups: KVCacheGroups
    page_bytes: int
    """One page of every layer slot on one device (the draft model's cache included)."""
    memory: dict[str, int]
    """Bytes per device of everything that takes device memory, by name: the consumers sized
    before the pool ("weights", "lora slots", "encoder cache", "recurrent state", "saved
    states") and then "kv cache"."""
    budget_bytes: int | None
    """What the KV pool could take on one device (the pool is all of it unless num_pages was
    given); None for a device that reports no memory, whose num_pages was given."""
    num_host_blocks: int = 0
    """Blocks of the prefix cache's host tier (`kv_offloading_size`); 0: none."""
    encoder_cache: tuple[int, int] = (0, 0)
    """An image-text model's encoder cache: (its blocks, the image tokens a step encodes)."""
    pooler: PoolerConfig | None = None
    """How a decoder served for pooling pools; None: it generates."""
    head: ClassifierHead | None = None
    """A sequence classifier's head (served for pooling)."""

    @property
    def num_pages(self) -> int:
        return self.config.cache.num_pages

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.parallel.tensor_parallel_size or 1

    @property
    def pooling(self) -> bool:
        return self.pooler is not None

    @property
    def num_state_snapshots(self) -> int:
        """A hybrid model's saved states for its prefix cache (0: none)."""
        cache = self.config.cache
        return (cache.num_state_snapshots or 0) if cache.enable_prefix_caching else 0


def serving_kind(config: EngineConfig) -> str:
    """What the checkpoint of `config` is served for: "encoder" (an encoder model: the pooling
    core), "pooling" (a decoder's hidden states pooled, or a sequence classifier) or
    "generate". The one place that decides it; raises on a runner the checkpoint cannot do."""
    path = resolve_model(config.load.model)
    if is_encoder(path):
        return "encoder"
    return "generate" if _pooler(config)[0] is None else "pooling"


def _pooler(config: EngineConfig) -> tuple[PoolerConfig | None, ClassifierHead | None]:
    """How a decoder served for pooling pools (see `LoadConfig.runner`), and a classifier's
    head; (None, None): it generates."""
    path = resolve_model(config.load.model)
    head = read_classifier(path)
    if head is not None:
        if config.load.runner == "generate":
            raise ValueError("runner generate: a sequence classification model does not generate")
        pooler = resolve_pooler_config(path, config.load.pooler_config, DECODER_CLASSIFIER_POOLER)
        return pooler, head
    if not decoder_pools(path, config.load.runner):
        if not has_lm_head(path):
            raise ValueError(
                f"runner {config.load.runner}: the checkpoint is a base model without an LM "
                "head; it serves pooling (embeddings) only"
            )
        if config.load.pooler_config is not None:
            raise ValueError("pooler_config: the model is not served for pooling (--runner)")
        return None, None
    return resolve_pooler_config(path, config.load.pooler_config, DECODER_POOLER), None


def encoder_plan(vision: VisionConfig | QwenVisionConfig, config: EngineConfig) -> tuple[int, int]:
    """(the encoder cache's blocks, the image tokens a step encodes) for the model's vision
    side. A model whose image tokens attend to each other needs a step to hold an image's
    tokens."""
    tokens, batched = vision.max_tokens_per_image, config.scheduler.max_num_batched_tokens
    if vision.bidirectional and batched < tokens:
        raise ValueError(
            f"max_num_batched_tokens ({batched}) must be >= {tokens}: this model computes "
            f"an image's {tokens} tokens in one step"
        )
    return config.multimodal.encoder_plan(tokens, vision.block_tokens, batched)


def host_blocks(cache: CacheConfig, block_bytes: int, *, multi: bool, draft: bool) -> int:
    """Blocks of the prefix cache's host tier (`kv_offloading_size` GiB, or a KV transfer
    role's default, over a whole block: a page of the cache's layer slots, every device's
    shard); 0 when off."""
    gib = cache.host_tier_gib
    if not gib:
        return 0
    # The tier is what a KV transfer role lands pulled blocks in: name what asked for it.
    name = "kv_offloading_size" if cache.kv_offloading_size else "kv_transfer_config"
    if multi:
        raise ValueError(f"{name} is not supported in a multi-host run")
    if draft:
        raise ValueError(f"{name} with a draft model or head (EAGLE-3, MTP) is not supported")
    blocks = int(gib * 2**30 // block_bytes)
    if blocks < 1:
        raise ValueError(
            f"{name}: a host tier of {gib} GiB holds no block of "
            f"{block_bytes / 2**20:.2f} MiB (one page of {cache.page_size} tokens)"
        )
    return blocks


def _consumers(
    config: EngineConfig,
    model_config: ModelConfig,
    memory: DeviceMemory,
    dtype: jnp.dtype,
    encoder: tuple[int, int],
    vision: VisionConfig | QwenVisionConfig | None,
) -> dict[str, int]:
    """Bytes per device of what is sized before the KV pool, by name. A new consumer of
    device memory is one entry here. (A hybrid's "saved states" are sized after these, from
    what they leave: `_saved_states`.)"""
    tp = config.parallel.tensor_parallel_size or 1
    itemsize = jnp.dtype(dtype).itemsize
    state = 0
    if model_config.linear_attention is not None:  # a slot per request (the batch's rows)
        state = config.scheduler.max_num_seqs * _state_slot_bytes(model_config, dtype, tp)
    return {
        "weights": memory.weights,
        "lora slots": lora_slot_bytes(model_config, config.lora, itemsize, tp),
        "encoder cache": 0 if vision is None else encoder_cache_bytes(vision, encoder[0], dtype),
        "recurrent state": state,
    }


def _state_slot_bytes(model_config: ModelConfig, dtype: jnp.dtype, tp: int) -> int:
    """One request's linear-attention state on one device (the heads split over tp)."""
    return -(-state_bytes_per_slot(model_config, dtype) // tp)


def _hybrid_rules(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """A hybrid model's (linear-attention layers beside attention) limits: its prefix cache
    needs saved states (`mamba_cache_mode` align, sized in `_saved_states`), or is off; the
    host tier, which would need them too, is refused by name, as is speculative decoding,
    whose rejected tokens would need the state rolled back."""
    if model_config.linear_attention is None:
        return config
    if config.speculative.method:
        raise ValueError(
            f"speculative_config: {model_config.architecture} has linear-attention layers, "
            "whose state cannot be rolled back to the last accepted token yet"
        )
    if config.cache.kv_offloading_size:
        raise ValueError(
            f"kv_offloading_size: {model_config.architecture} has linear-attention layers, "
            "whose saved states the host tier does not keep yet"
        )
    if config.cache.kv_transfer_config is not None:
        raise ValueError(
            f"kv_transfer_config: {model_config.architecture} has linear-attention layers, "
            "whose states are not transferred yet"
        )
    cache = config.cache
    if cache.enable_prefix_caching and (
        cache.mamba_cache_mode == "none" or cache.num_state_snapshots == 0
    ):
        logger.info(
            "%s has linear-attention layers and no saved states: prefix caching is off "
            "(prefixes are recomputed)",
            model_config.architecture,
        )
        config = config.replace(enable_prefix_caching=False)
    return config


def _saved_states(config: EngineConfig, slot_bytes: int, budget: int | None) -> int:
    """How many saved states a hybrid model's prefix cache keeps: `num_state_snapshots`, or
    max_num_seqs (one per request the batch can hold), or what a quarter of `budget` (the
    memory left for the cache, per device) holds, if less."""
    cache = config.cache
    if not cache.enable_prefix_caching:
        return 0
    if cache.num_state_snapshots is not None:
        return cache.num_state_snapshots
    slots = config.scheduler.max_num_seqs
    if budget is not None:
        slots = min(slots, max(budget, 0) // 4 // slot_bytes)
    return slots


def page_layout(
    config: EngineConfig,
    model_config: ModelConfig,
    draft_config: ModelConfig | None,
    mesh: Mesh | None,
    device: jax.Device,
) -> tuple[jnp.dtype, KVCacheGroups, int]:
    """(the KV cache's dtype, its layer groups, one page's bytes on one device with the draft
    model's or head's cache included) of an engine of `config` (tensor_parallel_size
    resolved) on `device`'s platform, or `mesh`."""
    cache, platform = config.cache, device.platform
    tp = config.parallel.tensor_parallel_size or 1
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, config.load.dtype, platform)
    placement = kv_cache_placement(mesh, kv_dtype, device)
    # A draft model shares the block tables for all its layers: one full group. A head's
    # (EAGLE-3, MTP) one layer reads the first group's (full attention where the model has any).
    spec = config.speculative.method
    draft_model = spec is not None and spec.method == "draft_model"
    groups = engine_kv_groups(model_config, cache, draft=draft_model)
    page_bytes = device_page_bytes(
        model_config, cache.page_size, kv_dtype, placement, tp, groups.num_slots
    )
    if draft_config is not None:
        page_bytes += device_page_bytes(draft_config, cache.page_size, kv_dtype, placement, tp)
    return kv_dtype, groups, page_bytes


def plan_engine(
    config: EngineConfig,
    model_config: ModelConfig,
    memory: DeviceMemory,
    *,
    dtype: jnp.dtype,
    mesh: Mesh | None = None,
    device: jax.Device | None = None,
    draft_config: ModelConfig | None = None,
    vision: VisionConfig | QwenVisionConfig | None = None,
    multi: bool = False,
) -> EnginePlan:
    """The plan of an engine of `config` (its attention backend resolved) serving a model of
    `model_config` (as sharded) whose weights are in `dtype`, on `device` (default: the first
    local one) or `mesh`, with `memory` of each device; `draft_config`: a draft model's
    or a head's one layer's (EAGLE-3, MTP: its KV shares the pages), `vision`: an image-text
    model's vision side, `multi`: a multi-host run. Raises `NoRoom` (a ValueError naming the
    setting) when the pool cannot hold a sequence, or one of max_model_len."""
    device = device or (jax.local_devices()[0] if mesh is None else mesh.devices.flat[0])
    platform = device.platform
    tp = config.parallel.tensor_parallel_size or (1 if mesh is None else mesh.size)
    config = _hybrid_rules(config.replace(tensor_parallel_size=tp), model_config)
    cache = config.cache
    pooler, head = _pooler(config)
    kv_dtype, groups, page_bytes = page_layout(config, model_config, draft_config, mesh, device)
    encoder = (0, 0) if vision is None else encoder_plan(vision, config)
    consumers = _consumers(config, model_config, memory, dtype, encoder, vision)
    # What the pool could take: reported with num_pages too (where the memory is known).
    cpu = memory.usable is None  # a fixed pool (the weights are not counted there)
    offered = memory.offered(cache)
    budget = None if cpu and platform != "cpu" else offered - sum(consumers.values())
    if model_config.linear_attention is not None:  # saved states: before the pool too
        slot_bytes = _state_slot_bytes(model_config, dtype, tp)
        snapshots = _saved_states(config, slot_bytes, budget)
        if snapshots == 0 and cache.enable_prefix_caching:
            logger.info("no room for saved states: prefix caching is off")
            config = config.replace(enable_prefix_caching=False)
        config = config.replace(num_state_snapshots=snapshots)
        cache = config.cache
        consumers["saved states"] = snapshots * slot_bytes
        if budget is not None:
            budget -= consumers["saved states"]
    if cache.num_pages is None and budget is None:
        raise NoRoom(
            f"the {device.device_kind} ({platform}) reports no memory limit to size the KV "
            "cache from; give the pool's size with num_pages (--num-gpu-blocks-override)"
        )
    if cache.num_pages is None and budget < 2 * page_bytes:
        taken = ", ".join(f"{k} {_gib(v)}" for k, v in consumers.items() if v) or "nothing"
        setting = (
            f"cpu_kv_cache_gib={cache.cpu_kv_cache_gib}"
            if cpu
            else f"memory_utilization={cache.memory_utilization}"
        )
        raise NoRoom(
            f"no device memory is left for the KV cache at {setting}: {taken} of the "
            f"{_gib(offered)} it offers; raise it or use a smaller model"
        )
    try:
        num_pages, max_model_len = plan_kv_cache(
            model_config,
            cache,
            kv_dtype,
            config.scheduler.max_model_len,
            tp,
            page_bytes=page_bytes,
            budget_bytes=budget,
            kv_groups=groups,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        )
    except ValueError as e:
        raise NoRoom(str(e)) from e
    config = config.replace(max_model_len=max_model_len, num_pages=num_pages)
    return EnginePlan(
        config,
        kv_dtype,
        groups,
        page_bytes,
        {**consumers, "kv cache": num_pages * page_bytes},
        budget,
        host_blocks(cache, page_bytes * tp, multi=multi, draft=draft_config is not None),
        encoder,
        pooler,
        head,
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
