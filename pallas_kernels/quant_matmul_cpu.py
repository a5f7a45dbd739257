"""Quantized matmul as a native CPU kernel (`cpu/quant_matmul.cc`), through the XLA FFI.

XLA's CPU backend does not fuse a dequantization into the dot that consumes it: the float
weight is written to memory and read back, so an int8 matrix-vector product ran 12x slower
than the float32 one. This kernel reads each quantized weight once, dequantizes it into an
L1-resident buffer and multiplies there. The weight layout is `jaxllm.quantization`'s
(output-major [O, I], group-wise scales and offsets along I); the .cc file's header says it
exactly. Built on first use (`native.py`); `available()` is False where it cannot be built,
and callers then dequantize with XLA ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native

_TARGET = "jaxllm_quant_matmul"
FORMATS = {"int8": 0, "int4": 1, "fp8": 2}


def _load() -> str | None:
    return native.load("quant_matmul", "JaxllmQuantMatmul", _TARGET)


def available() -> bool:
    """Whether the kernel could be built and registered (builds it on the first call)."""
    return _load() is None


def quant_matmul_cpu(
    x: jax.Array,  # f32[T, I]
    q: jax.Array,  # int8 [O, I], uint8 [O, I / 2] (int4) or float8_e4m3fn [O, I]
    scale: jax.Array,  # [O, G] float32 or float16
    offset: jax.Array | None,  # [O, G], scale's dtype
    fmt: str,
) -> jax.Array:  # f32[T, O]
    error = _load()
    if error is not None:
        raise RuntimeError(f"the cpu quantized matmul is unavailable: {error}")
    has_offset = offset is not None
    if offset is None:
        offset = jnp.zeros((1, 1), scale.dtype)
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32))(
        x.astype(jnp.float32),
        q,
        scale,
        offset,
        format=FORMATS[fmt],
        has_offset=has_offset,
    )
