"""How many KV pages fit, and how long a sequence may be.

On an accelerator the pool gets what `memory_utilization` of the local device leaves after the
weights (read from its memory stats; an accelerator that reports no limit is an error that
names `num_pages`); on CPU, where JAX reports no limit, a fixed budget (`cpu_kv_cache_gib`).
`memory_utilization` means vLLM's `gpu_memory_utilization` on a GPU: the engine's share of the
device's whole memory (`engine_bytes`), JAX's preallocated pool set to it before JAX starts
(`preallocate_gpu_memory`).
A page costs what its layout takes on the device (`device_page_bytes`): a TPU pads the cache's
minor dimensions to whole tiles, so the pool is sized from the compiled layout's bytes, not
from the logical ones. `max_model_len` defaults to the model's context, clipped to what the
pool can hold for one sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jaxllm.config import CacheConfig, ModelConfig, resolve_dtype
from jaxllm.worker.kv_groups import KVCacheGroups
from pallas_kernels import (
    QUANTIZED_KV_DTYPES,
    cache_head_dim,
    get_kv_cache_shape,
    kv_bytes_per_token_head,
)
from pallas_kernels.kv_cache import abstract_kv_cache, is_quantized_dtype

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: str, platform: str | None = None
) -> jnp.dtype:
    """The cache's dtype for `kv_cache_dtype` (see `CacheConfig`) and the weights' `dtype` on
    `platform` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    name = "fp8" if kv_cache_dtype == "fp8_e4m3" else kv_cache_dtype  # vLLM's alias
    if name in QUANTIZED_KV_DTYPES:
        return jnp.dtype(QUANTIZED_KV_DTYPES[name])
    if kv_cache_dtype != "auto":
        return jnp.dtype(resolve_dtype(kv_cache_dtype, platform))
    # On the CPU the KV cache stays float32 under bfloat16 weights: XLA's CPU backend
    # computes bfloat16 in float32, and converting the cache for the K/V write made every
    # forward program copy it, every step (found by the runner's in-place check).
    if platform == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(resolve_dtype(model_dtype, platform))


def bytes_per_page(
    config: ModelConfig,
    page_size: int,
    dtype: jnp.dtype,
    platform: str | None = None,
    num_slots: int | None = None,
) -> int:
    """Logical bytes of one page of `num_slots` layers (default: every attention layer; a
    model with layer groups: `KVCacheGroups.num_slots`), an 8-bit cache's scales included,
    with the heads as wide as `platform` makes them (`cache_head_dim`; default: the model's head_dim)."""
    heads = (num_slots or len(config.kv_layers)) * 2 * config.cache_kv_heads
    head_dim = config.cache_head_dim
    latent = config.latent_attention is not None
    head_dim = head_dim if platform is None else cache_head_dim(head_dim, platform, latent=latent)
    if latent:  # one row per token (two halves' lanes) under one scale
        scale = 4 if is_quantized_dtype(dtype) else 0
        return heads // 2 * page_size * (2 * head_dim * jnp.dtype(dtype).itemsize + scale)
    return heads * page_size * kv_bytes_per_token_head(head_dim, dtype)


def device_page_bytes(
    config: ModelConfig,
    page_size: int,
    dtype: jnp.dtype,
    sharding=None,
    num_devices: int = 1,
    num_slots: int | None = None,
) -> int:
    """Bytes one page of `num_slots` layers (default: every layer) takes on one device, in
    the layout the device gives the cache: on a TPU, from the compiled allocation of a cache
    (tiles pad its minor dimensions); elsewhere the logical bytes split over `num_devices`.
    `sharding`: the cache's (a `KVCache` of shardings, see
    `jaxllm.sharding.kv_cache_sharding`), or a single device's sharding."""
    num_slots = num_slots or len(config.kv_layers)
    if sharding is None:
        return -(-bytes_per_page(config, page_size, dtype, None, num_slots) // num_devices)
    if not isinstance(sharding, tuple):  # one sharding for the data and the scales
        sharding = (sharding, sharding)
    device = next(iter(sharding[0].device_set))
    logical = bytes_per_page(config, page_size, dtype, device.platform, num_slots)
    logical = -(-logical // num_devices)
    if device.platform != "tpu":
        return logical
    args = (num_slots, page_size, config.cache_kv_heads, config.cache_head_dim)
    latent = config.latent_attention is not None
    small, large = (
        _compiled_cache_bytes(n, *args, jnp.dtype(dtype), sharding, latent) for n in (64, 128)
    )
    return max(logical, -(-(large - small) // 64))


@functools.lru_cache(maxsize=64)
def _compiled_cache_bytes(
    num_pages, num_layers, page_size, num_kv_heads, head_dim, dtype, sharding, latent=False
):
    """The per-device bytes of an allocated cache of `num_pages`, from its compiled program."""
    platform = next(iter(sharding[0].device_set)).platform
    shape = get_kv_cache_shape(
        num_layers, num_pages, page_size, num_kv_heads, head_dim, platform, latent=latent
    )
    abstract = abstract_kv_cache(shape, dtype, sharding)
    outs = jax.tree.map(lambda a: a.sharding, abstract)
    zeros = jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=outs
    )
    return zeros.lower().compile().memory_analysis().output_size_in_bytes


# On a GPU, the share of the engine's pool kept for what the programs allocate as they run
# (their temporaries: 0.2-0.3 GiB for Llama-3.1-8B's and Qwen3-30B-A3B's at the default batch
# bounds, `jaxllm compile`), XLA's autotuning scratch while warmup compiles (the largest matrix
# product's operands: 1.1 GiB for an 8B model's output head), and cuBLAS's workspaces: 1.8 GiB
# of an H100's pool at 0.9, where vLLM's profiling run finds 1-2 GiB of activations.
GPU_RESERVE = 0.025
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def preallocate_gpu_memory(memory_utilization: float) -> None:
    """Makes JAX's GPU memory pool `memory_utilization` of the device (vLLM's meaning of
    gpu_memory_utilization) instead of JAX's default 75%, by setting
    XLA_PYTHON_CLIENT_MEM_FRACTION before JAX starts its GPU backend: unless it is set already
    (the operator's choice wins) or the backend has started (then what JAX took is what there
    is; `engine_bytes` reads it)."""
    import os

    from jax._src import xla_bridge

    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ or xla_bridge.backends_are_initialized():
        return
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_utilization:.4f}"


def gpu_pool_fraction(memory_utilization: float) -> float:
    """The share of a GPU's memory JAX preallocates for this process:
    XLA_PYTHON_CLIENT_MEM_FRACTION, as `preallocate_gpu_memory` sets it from
    `memory_utilization` where the operator did not."""
    import os

    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", memory_utilization))


def engine_bytes(platform: str, limit_bytes: int, memory_utilization: float) -> int:
    """What the engine's arrays (weights, KV cache, LoRA slots, encoder cache) may take of one
    device whose programs may use `limit_bytes`. On a TPU (`limit_bytes` about its HBM):
    `memory_utilization` of it, the rest for the programs' temporaries. On a GPU
    (`limit_bytes`: JAX's pool, `gpu_pool_fraction` of the whole memory): `memory_utilization`
    of the whole memory, at most the pool, less `GPU_RESERVE` of it."""
    if platform not in _GPU_PLATFORMS:
        return int(limit_bytes * memory_utilization)
    whole = limit_bytes / gpu_pool_fraction(memory_utilization)
    pool = min(limit_bytes, memory_utilization * whole)
    return int(pool * (1 - GPU_RESERVE))


def device_memory_limit(device: jax.Device) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) of a device's memory, or None where JAX reports none (the
    CPU)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device offers the engine's arrays."""

    usable: int | None
    """Bytes the engine's arrays (weights, KV cache and the other consumers) may take of one
    device (`kv_sizing.engine_bytes`); None on the CPU, where JAX reports no limit and the KV
    cache gets `cpu_kv_cache_gib` after the other consumers (not the weights)."""
    weights: int = 0
    """Bytes the weights take of it: in use once loaded (`serve`), or as the target lays the
    abstract ones out (`jaxllm compile`); 0 on the CPU."""

    @classmethod
    def of(cls, cache: CacheConfig, device: jax.Device) -> DeviceMemory:
        """A local device's memory with the weights loaded: its limit and what is in use. A
        device other than the CPU that reports no limit is refused unless the pool's size is
        given (`num_pages`)."""
        limit = device_memory_limit(device)
        if limit is None:
            if device.platform != "cpu" and cache.num_pages is None:
                raise ValueError(
                    f"the {device.device_kind} ({device.platform}) reports no memory limit to "
                    "size the KV cache from; give the pool's size with num_pages "
                    "(--num-gpu-blocks-override)"
                )
            return cls(None)
        bytes_limit, in_use = limit
        return cls(engine_bytes(device.platform, bytes_limit, cache.memory_utilization), in_use)

    def offered(self, cache: CacheConfig) -> int:
        """What the engine's arrays may take: `usable`, or on the CPU `cpu_kv_cache_gib`."""
        return int(cache.cpu_kv_cache_gib * 2**30) if self.usable is None else self.usable


def plan_kv_cache(
    config: ModelConfig,
    cache: CacheConfig,
    dtype: jnp.dtype,
    max_model_len: int | None,
    tensor_parallel_size: int = 1,
    draft_config: ModelConfig | None = None,
    *,
    page_bytes: int | None = None,
    budget_bytes: int | None = None,
    kv_groups: KVCacheGroups | None = None,
    max_num_batched_tokens: int | None = None,
) -> tuple[int, int]:
    """Returns (num_pages, max_model_len), checked against each other and the model. Under
    tensor parallelism each device holds 1/tp of every page (its kv heads). A draft model
    (speculative decoding) keeps a cache of the same pages: each page costs both.
    `page_bytes`: one page's bytes on one device, both caches included (default: the logical
    bytes, see `device_page_bytes`); `budget_bytes`: the bytes the pool may take on one device
    (default: what `memory_utilization` of the first local device leaves after what is on it,
    or `cpu_kv_cache_gib` on the CPU). `kv_groups`: how the layers share the pages (default: one
    group of every layer); a sliding group holds at most its window and a step's
    `max_num_batched_tokens` of a sequence."""
    groups = kv_groups or KVCacheGroups.single(config.attention_layers)
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) is longer than the model's context "
                f"({config.max_position_embeddings})"
            )
    if page_bytes is None:
        page_bytes = bytes_per_page(config, cache.page_size, dtype, None, groups.num_slots)
        if draft_config is not None:
            page_bytes += bytes_per_page(draft_config, cache.page_size, dtype)
        page_bytes //= tensor_parallel_size
    if cache.num_pages is not None:
        num_pages = cache.num_pages
    else:
        if budget_bytes is None:
            memory = DeviceMemory.of(cache, jax.local_devices()[0])
            budget_bytes = memory.offered(cache) - memory.weights
        budget = budget_bytes
        num_pages = budget // page_bytes

    def pages(length: int) -> int:
        return pages_per_sequence(groups, length, cache.page_size, max_num_batched_tokens)

    if max_model_len is None:
        lo, hi = 1, config.max_position_embeddings  # the longest sequence the pool holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pages(mid) <= num_pages else (lo, mid - 1)
        max_model_len = lo if pages(lo) <= num_pages else 0
        if max_model_len < 2:
            raise ValueError(
                f"the KV cache holds {num_pages} page(s) of {cache.page_size} tokens, too few "
                f"for any sequence; give it more memory or num_pages"
            )
    elif pages(max_model_len) > num_pages:
        raise ValueError(
            f"max_model_len ({max_model_len}) needs {pages(max_model_len)} pages but the KV "
            f"cache has {num_pages}; lower max_model_len or raise num_pages"
        )
    logger.info(
        "KV cache: %d pages x %d tokens (%.1f MiB per device, %s), max_model_len %d",
        num_pages,
        cache.page_size,
        num_pages * page_bytes / 2**20,
        jnp.dtype(dtype).name,
        max_model_len,
    )
    return num_pages, max_model_len


def pages_per_sequence(
    groups: KVCacheGroups, length: int, page_size: int, max_num_batched_tokens: int | None = None
) -> int:
    """The most pages one sequence of `length` tokens holds at once: every block in a full
    group; in a sliding group of window w, with steps of at most `max_num_batched_tokens`
    (None: any), the blocks of w - 1 tokens before a step, the step's own and the previous
    step's (kept until keyed for the prefix cache, a step late under async scheduling), and
    one more where they straddle a block boundary."""
    blocks = -(-length // page_size)
    total = 0
    for window in groups.windows:
        if window is None or max_num_batched_tokens is None:
            total += blocks
        else:
            span = -(-(window - 1 + 2 * max_num_batched_tokens) // page_size) + 1
            total += min(blocks, span)
    return total
