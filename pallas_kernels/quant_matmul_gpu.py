"""Quantized matmul as a Pallas kernel for NVIDIA GPUs (Triton lowering).

`x [T, I] @ w.T` for a weight stored as `jaxllm.quantization` stores it: codes `q` in the
output-major layout [O, I] (int8, float8_e4m3fn, or int4 packed two to a byte in blocks of 32,
byte j of a block holding element j in its low nibble and element j + 16 in its high one), and
a scale and optional offset per group of `group_size` consecutive inputs, `[O, G]`:

    w[o, i] = float(q[o, i]) * scale[o, i // group_size] + offset[o, i // group_size]

XLA dequantizes such a weight into a float array in memory before its dot when it cannot fuse
the unpacking into the dot's operand (the int4 interleave is a reshape and a concatenation):
a decode step then reads the codes, writes the float weight and reads it back, several times
the bytes of the codes alone. This kernel reads each code once, from HBM into registers, and
dequantizes it there, right before the tensor-core dot.

The grid is (row block of x, column block of the output). Each program holds a
`[block_rows, block_cols]` f32 accumulator and walks the input axis in chunks of `depth`
code columns: it loads the codes of its output rows, widens them to f32, multiplies by the
scale and adds the offset of each code's group (a gather from the small `[O, G]` arrays, which
stay in cache, so any group size works, 32-element GGUF blocks as well as GPTQ's 128), rounds
the weight to x's dtype (the XLA path's `dequantize(w, x.dtype)`, up to a fused multiply-add's
rounding) and accumulates the chunk's dot in f32. Untuned: the gather of a factor per code,
rather than one per group, is the first thing to measure on a GPU.

int4 is not unpacked in place: the wrapper splits x's columns into those the low nibbles
multiply and those the high ones do (`x_lo[:, 16b + j] = x[:, 32b + j]`, `x_hi` the same +16),
a cheap reshape of the activations, so the kernel makes two dots of the same shape per chunk
and never interleaves registers.

The same kernel runs on the CPU in Pallas interpret mode (how the tests check it against the
XLA path) and lowers for CUDA on any machine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

FORMATS = ("int8", "int4", "fp8")
_INT4_BLOCK = 32  # elements per packed block: bytes j of a block hold elements j and j + 16
MIN_DOT = 16  # Triton's dot wants at least 16 along every axis


@dataclasses.dataclass(frozen=True)
class QuantMatmulBlocks:
    """A program's tile: `rows` of x (the token axis, padded to a multiple), `cols` output
    channels, and `depth` code columns per step of its loop over the input axis. Powers of
    two, at least 16 (Triton's dot)."""

    rows: int
    cols: int
    depth: int
    num_warps: int = 4
    num_stages: int = 2


def _largest_divisor(n: int, limit: int) -> int | None:
    """The largest power of two in [16, limit] dividing n, or None."""
    size = limit
    while size >= MIN_DOT:
        if n % size == 0:
            return size
        size //= 2
    return None


def default_blocks(num_tokens: int, num_out: int, code_cols: int) -> QuantMatmulBlocks | None:
    """The tile for x [num_tokens, .] times codes [num_out, code_cols], or None when the shapes
    have no power-of-two tiling (the caller then dequantizes with XLA ops).

    Decode (few tokens) is bound by reading the codes: 32 output channels a program make
    `num_out / 32` programs (128 at num_out = 4,096, about one per SM of an H100; fewer for
    narrow outputs such as 8B's k/v projections: no split over the inputs yet). Larger token
    counts take 64-row, 64-column tiles, each code chunk then serving more rows. Untuned: the
    GPU session (issue 19) measures them with `benchmarks/kernels/quant_matmul.py`.
    """
    rows = min(max(pl.next_power_of_2(num_tokens), MIN_DOT), 64)
    cols = _largest_divisor(num_out, 32 if num_tokens <= MIN_DOT else 64)
    depth = _largest_divisor(code_cols, 128)
    if cols is None or depth is None:
        return None
    return QuantMatmulBlocks(rows, cols, depth)


def _kernel(*refs, fmt: str, group_size: int, blocks: QuantMatmulBlocks, has_offset: bool):
    # refs: x (x_lo, x_hi for int4) [T', C], q [O, C], scale [O, G], offset [O, G]?, out [T', O]
    num_x = 2 if fmt == "int4" else 1
    x_refs, q_ref, scale_ref = refs[:num_x], refs[num_x], refs[num_x + 1]
    offset_ref = refs[num_x + 2] if has_offset else None
    o_ref = refs[-1]
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * blocks.rows, blocks.rows), blocks.rows)
    col0 = pl.multiple_of(pl.program_id(1) * blocks.cols, blocks.cols)
    out_ch = col0 + jnp.arange(blocks.cols, dtype=jnp.int32)  # [cols]
    chunk = jnp.arange(blocks.depth, dtype=jnp.int32)  # [depth]

    def weight(codes, inputs):  # f32[cols, depth] codes of inputs i32[depth] -> x's dtype
        # A gather, with arrays on both axes (the interpreter cannot mix them with slices).
        idx = (out_ch[:, None], jax.lax.div(inputs, group_size)[None, :])
        w = codes * scale_ref[idx].astype(jnp.float32)
        if offset_ref is not None:
            w = w + offset_ref[idx].astype(jnp.float32)
        return w.astype(x_refs[0].dtype)

    def body(k, acc):
        start = pl.multiple_of(k * blocks.depth, blocks.depth)
        codes = q_ref[pl.ds(col0, blocks.cols), pl.ds(start, blocks.depth)]
        cols = start + chunk  # code columns of this chunk
        if fmt == "int4":
            packed = codes.astype(jnp.int32)
            low = jax.lax.div(cols, 16) * _INT4_BLOCK + jax.lax.rem(cols, 16)
            parts = ((packed & 15, low), (packed >> 4, low + 16))
        else:
            parts = ((codes, cols),)
        for x_ref, (part, inputs) in zip(x_refs, parts, strict=True):
            w = weight(part.astype(jnp.float32), inputs)
            x = x_ref[rows, pl.ds(start, blocks.depth)]
            acc = acc + pltriton.dot(x, w, trans_b=True).astype(jnp.float32)
        return acc

    num_chunks = q_ref.shape[1] // blocks.depth
    acc = jax.lax.fori_loop(0, num_chunks, body, jnp.zeros((blocks.rows, blocks.cols), jnp.float32))
    o_ref[rows, pl.ds(col0, blocks.cols)] = acc


def quant_matmul_gpu(
    x: jax.Array,  # [T, I] float
    q: jax.Array,  # int8 [O, I], uint8 [O, I / 2] (int4) or float8_e4m3fn [O, I]
    scale: jax.Array,  # [O, G] float16 or float32
    offset: jax.Array | None,  # [O, G], scale's dtype
    fmt: str,
    *,
    blocks: QuantMatmulBlocks | None = None,
    interpret: bool = False,
) -> jax.Array:  # f32[T, O]
    """x @ w.T for the quantized w of the module docstring. `blocks` defaults to
    `default_blocks`; raises ValueError where the shapes have no tiling (see `supports`)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    num_tokens, num_in = x.shape
    num_out, code_cols = q.shape
    if code_cols * (2 if fmt == "int4" else 1) != num_in:
        raise ValueError(f"x has {num_in} inputs; {fmt} codes {q.shape} do not")
    if scale.shape[0] != num_out or num_in % scale.shape[1]:
        raise ValueError(f"scale {scale.shape} does not group the {num_in} inputs of {q.shape}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset {offset.shape} must have scale's shape {scale.shape}")
    blocks = blocks or default_blocks(num_tokens, num_out, code_cols)
    if blocks is None:
        raise ValueError(f"no tiling of x {x.shape} by {fmt} codes {q.shape}")
    for name in ("rows", "cols", "depth"):
        size = getattr(blocks, name)
        if size < MIN_DOT or size & (size - 1):
            raise ValueError(f"blocks.{name} must be a power of two >= {MIN_DOT}, got {size}")
    if num_out % blocks.cols or code_cols % blocks.depth:
        raise ValueError(f"{blocks} does not tile {fmt} codes {q.shape}")
    group_size = num_in // scale.shape[1]

    padded = -(-num_tokens // blocks.rows) * blocks.rows
    x = jnp.pad(x, ((0, padded - num_tokens), (0, 0)))
    if fmt == "int4":  # the columns the low and the high nibbles multiply
        halves = x.reshape(padded, num_in // _INT4_BLOCK, 2, _INT4_BLOCK // 2)
        xs = [halves[:, :, h].reshape(padded, code_cols) for h in (0, 1)]
    else:
        xs = [x]
    kernel = functools.partial(
        _kernel, fmt=fmt, group_size=group_size, blocks=blocks, has_offset=offset is not None
    )
    out = pl.pallas_call(
        kernel,
        grid=(padded // blocks.rows, num_out // blocks.cols),
        out_shape=jax.ShapeDtypeStruct((padded, num_out), jnp.float32),
        compiler_params=pltriton.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name=f"quant_matmul_{fmt}_gpu",
    )(*xs, q, scale, *([] if offset is None else [offset]))
    return out[:num_tokens]


def supports(num_tokens: int, num_out: int, num_in: int, fmt: str) -> bool:
    """Whether `quant_matmul_gpu` tiles these shapes with its default blocks."""
    code_cols = num_in // 2 if fmt == "int4" else num_in
    return fmt in FORMATS and default_blocks(num_tokens, num_out, code_cols) is not None
