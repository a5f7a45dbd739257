"""Attention and KV-cache kernels with their pure-JAX references.

`ragged_paged_attention` is the one entry point the model calls; `backend` picks the
implementation, all behind one signature and one cache layout (`kv_cache.py`: float, or 8-bit
with a scale per token and head, which every backend reads):
- `reference`: plain JAX (`ragged_attention_reference.py`), the ground truth;
- `cpu`: a native C++ kernel for the CPU through the XLA FFI (`ragged_attention_cpu.py`, built on
  first use), the CPU default;
- `xla`: plain JAX laid out for the CPU (`ragged_attention_xla.py`), the CPU default where the
  native kernel cannot be built (no C++ compiler);
- `pallas_tpu`: a Mosaic TPU kernel (`ragged_attention_tpu.py`);
- `pallas_gpu`: a Pallas Triton kernel for NVIDIA GPUs (`ragged_attention_gpu.py`).
The engine's `attention_backend` is one of `ATTENTION_BACKENDS`: "auto" picks the kernel of the
platform (`cpu` on CPU, or `xla` without a compiler), "pallas" the platform's Pallas kernel (the
TPU kernel in interpret mode on CPU, for checking it there). Off their platform the Pallas
kernels run only in interpret mode, which `interpret=None` turns on by itself.

`gated_delta_rule` is the hybrid models' recurrence (Gated DeltaNet), over the same ragged
batches, in four forms (`GDN_BACKENDS`): the token-by-token reference, the chunked XLA form, and
Pallas kernels for TPUs (`gated_delta_rule_tpu.py`) and NVIDIA GPUs (in `gated_delta_rule.py`).

`mla_paged_attention` is DeepSeek's multi-head latent attention over the same cache, one row
[latent | RoPE key] per token (`mla_attention.py`, `write_latent`): a Triton kernel on GPUs
(`mla_attention_gpu.py`), plain JAX elsewhere.

The sliding window is data, not a compile-time constant: `ragged_paged_attention` turns
`sliding_window` (None, an int, or an i32 scalar that may be traced) into one i32[] operand,
0 for none, and every backend reads it at run time. So a layer scan can carry each layer's
window (Gemma 3 mixes windowed and global layers), and one compiled step serves them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_attention_cpu
from pallas_kernels.attention_sinks import check_sinks
from pallas_kernels.gated_delta_rule import GDN_BACKENDS, gated_delta_rule
from pallas_kernels.kv_cache import (
    QUANTIZED_KV_DTYPES,
    KVCache,
    as_kv_cache,
    cache_head_dim,
    get_kv_cache_shape,
    is_quantized_dtype,
    kv_bytes_per_token_head,
    write_kv,
    zeros_kv_cache,
)
from pallas_kernels.mla_attention import mla_paged_attention, write_latent
from pallas_kernels.ragged_attention_cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_attention_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_attention_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_attention_xla import ragged_paged_attention_xla
from pallas_kernels.target import (
    compute_capability,
    current_device,
    current_device_kind,
    current_platform,
    lowering_platform,
    target_platform,
)
from pallas_kernels.tuning import BlockSizes, exact_float32_dots, get_block_sizes

BACKENDS = ("reference", "xla", "cpu", "pallas_tpu", "pallas_gpu")
ATTENTION_BACKENDS = ("auto", "pallas", *BACKENDS)
_NATIVE_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cpu": "cpu"}
_MAX_WINDOW = np.iinfo(np.int32).max  # a longer static window is the same as this one

# The optional operands of `ragged_paged_attention`, each with the backends whose kernels
# honour it. A new operand (a new kind of mask, say) is an entry here, its check in
# `ragged_paged_attention`, and the kernels that take it: a backend left out refuses it by
# name (`check_operands`) instead of ignoring it, so a model that needs it cannot be served
# wrong on that backend, and each kernel can learn it in its own change.
_EVERY_BACKEND = frozenset(BACKENDS)
ATTENTION_OPERANDS: dict[str, frozenset[str]] = {
    "sliding_window": _EVERY_BACKEND,
    "soft_cap": _EVERY_BACKEND,
    "attend_to": _EVERY_BACKEND,
    "sinks": _EVERY_BACKEND,
    "attention_chunk": _EVERY_BACKEND,
}


def check_operands(backend: str, operands: dict[str, object]) -> None:
    """Raises, naming the operand, if `backend` does not honour one that is set (not None)."""
    for name, value in operands.items():
        if value is None:
            continue
        honoured = ATTENTION_OPERANDS.get(name)
        if honoured is None:
            raise ValueError(
                f"unknown attention operand {name!r}; known: {list(ATTENTION_OPERANDS)}"
            )
        if backend not in honoured:
            raise ValueError(
                f"attention_backend {backend!r} does not support {name}; these do: "
                f"{', '.join(b for b in BACKENDS if b in honoured)}"
            )


def _window_operand(sliding_window: int | jax.Array | None) -> jax.Array:  # i32[]
    """`sliding_window` as the i32[] every backend takes: the window (>= 1), or <= 0 for none.
    A static int must be >= 1; an array (possibly traced) may hold any value."""
    if sliding_window is None:
        return jnp.zeros((), jnp.int32)
    if isinstance(sliding_window, int | np.integer) and not isinstance(sliding_window, bool):
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        return jnp.int32(min(int(sliding_window), _MAX_WINDOW))
    if not isinstance(sliding_window, jax.Array | np.ndarray):
        raise ValueError(
            f"sliding_window must be None, an int or an integer scalar array, got "
            f"{type(sliding_window).__name__}"
        )
    if sliding_window.shape != () or not jnp.issubdtype(sliding_window.dtype, jnp.integer):
        raise ValueError(
            f"sliding_window must be an integer scalar array, got {sliding_window.dtype}"
            f"{list(sliding_window.shape)}"
        )
    return jnp.asarray(sliding_window).astype(jnp.int32)


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """Maps an engine `attention_backend` to one of `BACKENDS` for `platform` (default: JAX's
    default backend): "auto" is the platform's Pallas kernel, or on CPU the native kernel
    (`xla` where it cannot be built);
    "pallas" is the platform's kernel, the TPU one on CPU (interpreted)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    platform = platform or jax.default_backend()
    kernel = "pallas_gpu" if platform in ("gpu", "cuda", "rocm") else "pallas_tpu"
    if backend == "auto":
        if platform == "cpu":
            return "cpu" if ragged_attention_cpu.available() else "xla"
        return kernel
    if backend == "pallas":
        return kernel
    if backend in _NATIVE_PLATFORM and platform not in ("cpu", _NATIVE_PLATFORM[backend]):
        raise ValueError(f"attention_backend {backend!r} cannot run on platform {platform!r}")
    return backend


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array | KVCache,  # [L, num_pages, K, page_size, 2H]
    layer: jax.Array | int,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    attend_to: jax.Array | None = None,  # i32[T]
    sinks: jax.Array | None = None,  # f32[N]
    attention_chunk: int | None = None,
    backend: str = "reference",
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [T, N, H]
    """Causal attention of a ragged batch of queries over one layer of the paged KV cache.

    Request r's queries are rows `cu_q_lens[r]:cu_q_lens[r + 1]` of `q`, the last of its
    `seq_lens[r]` tokens, whose K/V are already in the cache (`write_kv` first). Requests from
    `num_seqs[0]` on are padding, as are rows past `cu_q_lens[num_seqs[0]]`: they read nothing
    and return zeros. A query at position q sees key position k iff k <= q and, with a
    `sliding_window` w, k > q - w. The window is None (full attention), an int >= 1, or an
    integer scalar array, possibly traced (a layer scan's per-layer window), in which a value
    <= 0 means full attention. `attend_to` widens the causal order per query: a query at
    position q with a = attend_to[t] sees the keys up to max(q, a) (still within the window
    behind q), so the tokens of a block (an image whose tokens attend to each other, Gemma 3's)
    see each other; the keys past q it names must be this step's tokens of the same request,
    and -1 (or anything <= q) is plain causal. `sinks` (gpt-oss): one logit per query head,
    in the units of the scaled scores, added to every row's softmax denominator as a key with
    a zero value (`attention_sinks.py`). `attention_chunk` C (Llama 4's chunked local
    attention, a static int): a query at position q sees only the keys of its own chunk of C
    positions, k >= (q // C) * C (with the window, if any, besides). `block_sizes` overrides the tuning table for the
    Pallas backends; `interpret=None` interprets them when the platform is not theirs (e.g.
    on CPU).

    The cache is a float array or a `KVCache`, whose 8-bit data every backend dequantizes
    as it reads (`kv_cache.py`); the output has q's dtype.
    """
    kv_cache, kv_scales = as_kv_cache(kv_cache)
    num_tokens, num_heads, head_dim = q.shape
    if kv_cache.ndim != 5 or kv_cache.shape[4] % 2 or kv_cache.shape[4] < 2 * head_dim:
        raise ValueError(
            f"kv_cache must be [layers, pages, K, page_size, 2W], W >= head_dim {head_dim} "
            f"(see get_kv_cache_shape), got {kv_cache.shape}"
        )
    if kv_cache.shape[4] > 2 * head_dim:
        # A cache padded to the platform's lanes (`cache_head_dim`): zero query lanes meet its
        # zero key lanes, and the output's padding lanes (zero values) are dropped.
        width = kv_cache.shape[4] // 2
        padded = jnp.pad(q, ((0, 0), (0, 0), (0, width - head_dim)))
        out = ragged_paged_attention(
            padded, KVCache(kv_cache, kv_scales), layer, seq_lens, block_tables, cu_q_lens,
            num_seqs, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            attend_to=attend_to, sinks=sinks, attention_chunk=attention_chunk, backend=backend,
            block_sizes=block_sizes, interpret=interpret,
        )  # fmt: skip
        return out[..., :head_dim]
    if num_heads % kv_cache.shape[2]:
        raise ValueError(
            f"q heads ({num_heads}) must be a multiple of kv heads ({kv_cache.shape[2]})"
        )
    max_reqs = block_tables.shape[0]
    if seq_lens.shape != (max_reqs,) or cu_q_lens.shape != (max_reqs + 1,):
        raise ValueError(
            f"seq_lens must be [{max_reqs}] and cu_q_lens [{max_reqs + 1}] for block_tables "
            f"{block_tables.shape}; got {seq_lens.shape} and {cu_q_lens.shape}"
        )
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got {num_seqs.shape}")
    window = _window_operand(sliding_window)
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float array, got {q.dtype}")
    if attend_to is not None and (attend_to.shape != (num_tokens,) or attend_to.dtype != jnp.int32):
        raise ValueError(
            f"attend_to must be i32[{num_tokens}], got {attend_to.dtype}{attend_to.shape}"
        )
    sinks = check_sinks(sinks, num_heads)
    if attention_chunk is not None and (
        not isinstance(attention_chunk, int | np.integer)
        or isinstance(attention_chunk, bool)
        or attention_chunk < 1
    ):
        raise ValueError(f"attention_chunk must be None or an int >= 1, got {attention_chunk!r}")
    args = (q, kv_cache, layer, seq_lens, block_tables, cu_q_lens, num_seqs)
    kwargs = dict(
        sm_scale=sm_scale,
        sliding_window=window,
        soft_cap=soft_cap,
        kv_scales=kv_scales,
        attend_to=attend_to,
        sinks=sinks,
        attention_chunk=None if attention_chunk is None else int(attention_chunk),
    )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_operands(
        backend,
        dict(
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            attend_to=attend_to,
            sinks=sinks,
            attention_chunk=attention_chunk,
        ),
    )
    if backend == "reference":
        return ragged_paged_attention_reference(*args, **kwargs)
    if backend == "xla":
        return ragged_paged_attention_xla(*args, **kwargs)
    if backend == "cpu":
        return ragged_paged_attention_cpu(*args, **kwargs)

    page_size = kv_cache.shape[3]
    if interpret is None:
        interpret = current_platform() != _NATIVE_PLATFORM[backend]
    if block_sizes is None:
        # Interpreted: the "cpu" rows (fewer, larger blocks). Native: the device's rows, or
        # the backend's defaults ("*") when lowering from another platform with no target
        # device given (`target_platform`).
        device_kind = "cpu" if interpret else current_device_kind()
        if not interpret and current_platform() != _NATIVE_PLATFORM[backend]:
            device_kind = "*"
        block_sizes = get_block_sizes(
            backend,
            head_dim=head_dim,
            page_size=page_size,
            num_tokens=num_tokens,
            max_reqs=max_reqs,
            device_kind=device_kind,
            group=num_heads // kv_cache.shape[2],
            kv_itemsize=kv_cache.dtype.itemsize,
            q_itemsize=q.dtype.itemsize,
            exact_float32=exact_float32_dots(),
            num_kv_heads=kv_cache.shape[2],
        )
    if backend == "pallas_tpu":
        if page_size % 8:
            raise ValueError(f"pallas_tpu needs page_size a multiple of 8, got {page_size}")
        return ragged_paged_attention_tpu(
            *args,
            **kwargs,
            q_block=block_sizes.q_block,
            kv_pages=block_sizes.kv_pages,
            interpret=interpret,
        )
    if kv_scales is not None and kv_cache.dtype == jnp.uint8 and not interpret:
        capability = compute_capability()
        if capability is not None and capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype fp8 needs a GPU that converts float8 e4m3 (compute capability "
                f"8.9 or newer: Ada, Hopper); this {current_device_kind()} is "
                f"{'.'.join(map(str, capability))}: use kv_cache_dtype int8"
            )
    for name, value in (
        ("page_size", page_size),
        ("head_dim", head_dim),
        ("block_sizes.q_block", block_sizes.q_block),
        ("block_sizes.kv_pages", block_sizes.kv_pages),
    ):
        if value & (value - 1):
            raise ValueError(f"pallas_gpu needs {name} a power of two, got {value}")
    return ragged_paged_attention_gpu(
        *args,
        **kwargs,
        q_block=block_sizes.q_block,
        kv_pages=block_sizes.kv_pages,
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        num_splits=block_sizes.num_splits,
        interpret=interpret,
    )


__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_OPERANDS",
    "BACKENDS",
    "GDN_BACKENDS",
    "QUANTIZED_KV_DTYPES",
    "BlockSizes",
    "KVCache",
    "as_kv_cache",
    "cache_head_dim",
    "check_operands",
    "compute_capability",
    "current_device",
    "gated_delta_rule",
    "current_device_kind",
    "current_platform",
    "get_block_sizes",
    "get_kv_cache_shape",
    "is_quantized_dtype",
    "kv_bytes_per_token_head",
    "lowering_platform",
    "mla_paged_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_cpu",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_xla",
    "resolve_backend",
    "target_platform",
    "write_kv",
    "write_latent",
    "zeros_kv_cache",
]
