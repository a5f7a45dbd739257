"""Attention and KV-cache kernels with their pure-JAX references.

`ragged_paged_attention` is the one entry point the model calls; `backend` picks the
implementation. Only the plain-JAX `reference` backend exists so far; the Pallas TPU and GPU
kernels will plug in behind the same signature and the same cache layout (`kv_cache.py`).
"""

from __future__ import annotations

import jax

from pallas_kernels.kv_cache import get_kv_cache_shape, write_kv
from pallas_kernels.ragged_attention_reference import ragged_paged_attention_reference

BACKENDS = ("reference",)


def resolve_backend(backend: str) -> str:
    """Maps "auto" to the backend for the current platform and checks the name."""
    if backend == "auto":
        return "reference"
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be auto or one of {BACKENDS}, got {backend!r}")
    return backend


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, page_size, 2K, H]
    layer: jax.Array | int,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "reference",
) -> jax.Array:  # [T, N, H]
    """Causal attention of a ragged batch of queries over one layer of the paged KV cache."""
    num_tokens, num_heads, head_dim = q.shape
    if kv_cache.ndim != 5 or kv_cache.shape[4] != head_dim or kv_cache.shape[3] % 2:
        raise ValueError(
            f"kv_cache must be [layers, pages, page_size, 2K, {head_dim}], got {kv_cache.shape}"
        )
    if num_heads % (kv_cache.shape[3] // 2):
        raise ValueError(
            f"q heads ({num_heads}) must be a multiple of kv heads ({kv_cache.shape[3] // 2})"
        )
    max_reqs = block_tables.shape[0]
    if seq_lens.shape != (max_reqs,) or cu_q_lens.shape != (max_reqs + 1,):
        raise ValueError(
            f"seq_lens must be [{max_reqs}] and cu_q_lens [{max_reqs + 1}] for block_tables "
            f"{block_tables.shape}; got {seq_lens.shape} and {cu_q_lens.shape}"
        )
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got {num_seqs.shape}")
    backend = resolve_backend(backend)
    return ragged_paged_attention_reference(
        q,
        kv_cache,
        layer,
        seq_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )


__all__ = [
    "BACKENDS",
    "get_kv_cache_shape",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_backend",
    "write_kv",
]
