"""Ragged paged attention as a native CPU kernel (`cpu/ragged_attention.cc`), through the XLA FFI.

The kernel is C++ compiled on first use (see `native.py`). Where it cannot be built,
`available()` is False (the reason is logged) and `resolve_backend("auto")` uses the `xla`
backend instead.

Why C++ here when the accelerators get Pallas: Pallas runs on a CPU only in interpret mode,
and attention written with XLA ops copies and transposes the gathered pages for matmuls that
XLA's CPU backend runs slowly at these shapes (see the .cc file's header). JAX's FFI is the
supported way to add such an op; the call is a custom call inside the same jitted step, reads
the KV cache in place (no copy: checked by the runner's in-place test), and runs on the
step's own threads (XLA's intra-op thread pool, `cpu/parallel.h`).

The sliding window is an operand of the call (i32[1], <= 0: none), not an attribute, so a
traced window (a layer scan's) works; the kernel still reads no token before a work item's
window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

_TARGET = "jaxllm_ragged_paged_attention"


def _load() -> str | None:
    return native.load("ragged_attention", "JaxllmRaggedPagedAttention", _TARGET)


def available() -> bool:
    """Whether the kernel could be built and registered (builds it on the first call)."""
    return _load() is None


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [L, num_pages, K, page_size, 2H]
    layer: jax.Array | int,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: jax.Array,  # i32[]  keys a query sees back from itself; <= 0: all
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,  # f32[L, num_pages, 1, 2K * page_size]  8-bit only
    attend_to: jax.Array | None = None,  # i32[T]  see `ragged_paged_attention`
    sinks: jax.Array | None = None,  # f32[N]  see `ragged_paged_attention`
    attention_chunk: int | None = None,  # static  see `ragged_paged_attention`
) -> jax.Array:  # [T, N, H]
    out_dtype = q.dtype
    if kv_scales is not None:  # an 8-bit cache: the kernel widens it to float32 as it reads
        q = q.astype(jnp.float32)
    elif q.dtype != kv_cache.dtype or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"the cpu backend needs q and kv_cache both float32 or both bfloat16, got {q.dtype} "
            f"and {kv_cache.dtype}"
        )
    error = _load()
    if error is not None:
        raise RuntimeError(f"the cpu attention backend is unavailable: {error}")
    i32 = jnp.int32
    scales = jnp.zeros(1, jnp.float32) if kv_scales is None else kv_scales
    out = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q,
        kv_cache,
        scales,
        jnp.asarray(layer, i32).reshape(1),
        seq_lens.astype(i32),
        block_tables.astype(i32),
        cu_q_lens.astype(i32),
        num_seqs.astype(i32),
        jnp.asarray(sliding_window, i32).reshape(1),
        jnp.full(1, -1, i32) if attend_to is None else attend_to.astype(i32),
        jnp.zeros(0, jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
        attention_chunk=np.int64(attention_chunk or 0),
    )
    return out.astype(out_dtype)
