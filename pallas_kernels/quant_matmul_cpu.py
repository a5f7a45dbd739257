"""Quantized matmul as a native CPU kernel (`cpu/quant_matmul.cc`), through the XLA FFI.

XLA's CPU backend does not fuse a dequantization into the dot that consumes it: the float
weight is written to memory and read back, so an int8 matrix-vector product ran 12x slower
than the float32 one. This kernel reads each quantized weight once, dequantizes it into an
L1-resident buffer and multiplies there. The weight layout is `jaxllm.quantization`'s
(output-major [O, I], group-wise scales and offsets along I); the .cc file's header says it
exactly. Built on first use (`native.py`); `available()` is False where it cannot be built,
and callers then dequantize with XLA ops.

Where the CPU has 8-bit dot products (AVX-512 VNNI, AVX-VNNI), or AVX2 to stand in for them
(`vpmaddubsw`), int8 and int4 take an integer path: x rounded to int8 per 16 inputs, 8-bit
products against the codes summed exactly in int32 (`path()` names the one built).
`VARIANTS` are the builds a test or benchmark can ask for on a CPU that has them all: each one
is checked against the reference in tests/test_quantization.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import native

_TARGET = "jaxllm_quant_matmul"
FORMATS = {"int8": 0, "int4": 1, "fp8": 2}
# Extra compiler flags per variant, after -march=native: "native" is what this CPU gets;
# "avx_vnni" is the 256-bit integer path of CPUs with AVX-VNNI but no AVX-512 (on a CPU
# without AVX-VNNI, the AVX2 one); "avx2" the integer path of CPUs with neither (`vpmaddubsw`);
# "float" dequantizes to float32.
VARIANTS = {
    "native": (),
    "avx_vnni": ("-mno-avx512f",),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),
    "float": ("-mno-avx512f", "-mno-avxvnni", "-DJAXLLM_NO_AVX2_INT_PATH"),
}


def _target(variant: str) -> str:
    return _TARGET if variant == "native" else f"{_TARGET}_{variant}"


def _load(variant: str = "native") -> str | None:
    return native.load("quant_matmul", "JaxllmQuantMatmul", _target(variant), VARIANTS[variant])


def available(variant: str = "native") -> bool:
    """Whether the kernel could be built and registered (builds it on the first call)."""
    return _load(variant) is None


def path(variant: str = "native") -> str:
    """The path int8 and int4 take in that build: "avx512_vnni", "avx_vnni", "avx2" or
    "float"."""
    import ctypes

    fn = native.library("quant_matmul", VARIANTS[variant]).JaxllmQuantMatmulPath
    fn.restype = ctypes.c_char_p
    return fn().decode()


def quant_matmul_cpu(
    x: jax.Array,  # f32[T, I]
    q: jax.Array,  # int8 [O, I], uint8 [O, I / 2] (int4) or float8_e4m3fn [O, I]
    scale: jax.Array,  # [O, G] float32 or float16
    offset: jax.Array | None,  # [O, G], scale's dtype
    fmt: str,
    variant: str = "native",
) -> jax.Array:  # f32[T, O]
    (out,) = quant_matmuls_cpu(x, [(q, scale, offset)], fmt, variant)
    return out


def quant_matmuls_cpu(
    x: jax.Array,  # f32[T, I]
    matrices: Sequence[tuple[jax.Array, jax.Array, jax.Array | None]],  # (q, scale, offset)
    fmt: str,
    variant: str = "native",
) -> list[jax.Array]:  # f32[T, O] each
    """x times each matrix in one kernel call (q, k and v of a layer: one quantization of x,
    one spread of all their rows over the threads, one call instead of three). The matrices
    share `fmt`, their group count G and scale dtype, and all have offsets or none. Each
    result equals the matrix's own call bit for bit."""
    error = _load(variant)
    if error is not None:
        raise RuntimeError(f"the cpu quantized matmul is unavailable: {error}")
    if not matrices:
        raise ValueError("matrices must not be empty")
    _, scale0, offset0 = matrices[0]
    has_offset = offset0 is not None
    for _, scale, offset in matrices:
        if (offset is not None) != has_offset or scale.dtype != scale0.dtype:
            raise ValueError(
                "matrices of one call must all have offsets or none, and one scale dtype"
            )
        if scale.shape[1] != scale0.shape[1]:
            raise ValueError(
                f"matrices of one call must share G, got {scale.shape[1]} and {scale0.shape[1]}"
            )
    operands = []
    for q, scale, offset in matrices:
        operands += [q, scale, offset if has_offset else jnp.zeros((1, 1), scale.dtype)]
    results = [jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32) for q, _, _ in matrices]
    return list(
        jax.ffi.ffi_call(_target(variant), results)(
            x.astype(jnp.float32), *operands, format=FORMATS[fmt], has_offset=has_offset
        )
    )
