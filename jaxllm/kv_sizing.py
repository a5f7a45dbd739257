"""How many KV pages fit, and how long a sequence may be.

On an accelerator the pool gets what `memory_utilization` of the device leaves after the
weights (read from the device's memory stats); on CPU, where JAX reports no limit, a fixed
budget (`cpu_kv_cache_gib`). `max_model_len` defaults to the model's context, clipped to what
the pool can hold for one sequence.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxllm.config import CacheConfig, ModelConfig, resolve_dtype
from pallas_kernels import QUANTIZED_KV_DTYPES, kv_bytes_per_token_head

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> jnp.dtype:
    """The cache's dtype for `kv_cache_dtype` (see `CacheConfig`) and the weights' `dtype`."""
    name = "fp8" if kv_cache_dtype == "fp8_e4m3" else kv_cache_dtype  # vLLM's alias
    if name in QUANTIZED_KV_DTYPES:
        return jnp.dtype(QUANTIZED_KV_DTYPES[name])
    if kv_cache_dtype != "auto":
        return jnp.dtype(resolve_dtype(kv_cache_dtype))
    # On the CPU the KV cache stays float32 under bfloat16 weights: XLA's CPU backend
    # computes bfloat16 in float32, and converting the cache for the K/V write made every
    # forward program copy it, every step (found by the runner's in-place check).
    if jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(resolve_dtype(model_dtype))


def bytes_per_page(config: ModelConfig, page_size: int, dtype: jnp.dtype) -> int:
    """Bytes of one page of every layer, an 8-bit cache's scales included."""
    heads = config.num_layers * 2 * config.num_kv_heads
    return heads * page_size * kv_bytes_per_token_head(config.head_dim, dtype)


def kv_budget_bytes(cache: CacheConfig) -> int:
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return int(cache.cpu_kv_cache_gib * 2**30)
    # The weights are already on the device, so bytes_in_use counts them.
    free = stats["bytes_limit"] * cache.memory_utilization - stats.get("bytes_in_use", 0)
    if free <= 0:
        raise ValueError(
            f"no device memory is left for the KV cache at memory_utilization="
            f"{cache.memory_utilization}; raise it or use a smaller model"
        )
    return int(free)


def plan_kv_cache(
    config: ModelConfig,
    cache: CacheConfig,
    dtype: jnp.dtype,
    max_model_len: int | None,
    tensor_parallel_size: int = 1,
    draft_config: ModelConfig | None = None,
) -> tuple[int, int]:
    """Returns (num_pages, max_model_len), checked against each other and the model. Under
    tensor parallelism each device holds 1/tp of every page (its kv heads). A draft model
    (speculative decoding) keeps a cache of the same pages: each page costs both."""
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) is longer than the model's context "
                f"({config.max_position_embeddings})"
            )
    page_bytes = bytes_per_page(config, cache.page_size, dtype)
    if draft_config is not None:
        page_bytes += bytes_per_page(draft_config, cache.page_size, dtype)
    if cache.num_pages is not None:
        num_pages = cache.num_pages
    else:
        num_pages = kv_budget_bytes(cache) // (page_bytes // tensor_parallel_size)
    capacity = num_pages * cache.page_size
    if max_model_len is None:
        max_model_len = min(config.max_position_embeddings, capacity)
        if max_model_len < 2:
            raise ValueError(
                f"the KV cache holds {num_pages} page(s) of {cache.page_size} tokens, too few "
                f"for any sequence; give it more memory or num_pages"
            )
    elif max_model_len > capacity:
        raise ValueError(
            f"max_model_len ({max_model_len}) needs {-(-max_model_len // cache.page_size)} "
            f"pages but the KV cache has {num_pages}; lower max_model_len or raise num_pages"
        )
    logger.info(
        "KV cache: %d pages x %d tokens (%.1f MiB, %s), max_model_len %d",
        num_pages,
        cache.page_size,
        num_pages * page_bytes / 2**20,
        jnp.dtype(dtype).name,
        max_model_len,
    )
    return num_pages, max_model_len
