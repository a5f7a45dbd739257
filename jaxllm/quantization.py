"""Quantized weights: one representation for every format, and the matmul that uses it.

A quantized weight is a `QArray`: the integers (or fp8 values) `q` of a matrix in torch's
output-major layout [O, I], with a `scale` and an optional `offset` per group of
`group_size` consecutive inputs (float16 where that holds them exactly, else float32):

    w[o, i] = float(q[o, i]) * scale[o, i // group_size] + offset[o, i // group_size]

- "int8": q int8 [O, I]; per-channel (one group per row) when quantized here, or GGUF's
  blocks (Q8_0, Q5_x and Q6_K values fit in int8).
- "int4": q uint8 [O, I / 2] holding values 0..15, two per byte in blocks of 32 along I:
  byte j of a block holds element j (low nibble) and element j + 16 (high nibble), GGUF's
  Q4_0 order. Group-wise scale and offset (the zero point times the scale, negated).
- "fp8": q float8_e4m3fn [O, I], per-channel scale.

The output-major layout keeps every format's blocks along the rows as their files store them
(GGUF, GPTQ and AWQ all group along the input), keeps an embedding's rows whole for the
lookup, and makes a tied output head the same matmul as any other layer.

The float32 formula above reproduces the `gguf` package's dequantization bit for bit for
every GGUF type we keep (see `loaders/gguf.py`): each product is exact or rounded once, as
there.

`quantization` (engine argument, vLLM's names): None keeps a checkpoint as it is stored (GPTQ,
AWQ and compressed-tensors checkpoints and, on accelerators, a GGUF file's quantized tensors
stay quantized; float checkpoints stay float; on the CPU a GGUF file is dequantized: kept
quantized it decodes faster up to 8 clients or more, but its prefill is slower, and float32
serves more at 32 clients (benchmarks/results/README.md)); "int8", "int4" or
"fp8" quantize every linear layer and the embedding at load (from the float weights, or from
a GGUF file's dequantized ones); "gguf", "gptq", "awq" and "compressed-tensors" are None,
spelled as vLLM does, and checked against the checkpoint (loaders/quantized_hf.py reads the
last three);
"fp8" on a fine-grained FP8 checkpoint (`quant_method: fp8`) keeps it as it is, its block
factors as groups (loaders/quantized_hf.py);
"float" dequantizes a GGUF file's tensors at load (float weights, as transformers loads a
GGUF file: for exact comparisons with it). int4 holds the output head as a `SplitRows`: the
rows of the most frequent tokens in int8, the rest in int4 (`quantize_head`).
Norms, biases, routers and mixture-of-experts weights stay float, but for gpt-oss's MXFP4
experts (`MXFP4Experts`, at the end: kept as shipped on accelerators, "mxfp4" anywhere).

The matmul (`qmatmul`) has three implementations, picked by the engine's
`quant_matmul_backend` (one of `config.QUANT_MATMUL_BACKENDS`, read from
`config.kernel_choices()` while the step is traced):
- "auto" on the CPU: a native kernel (`pallas_kernels/quant_matmul_cpu.py`) reads each weight
  once as stored (XLA's CPU backend would write the whole float weight to memory first: 12x
  slower than float32 at batch 1); where the CPU has 8-bit dot products or AVX2, int8 and
  int4 take its integer path (activations rounded to int8 per 16 inputs, as llama.cpp does);
- "xla", and "auto" on TPU and GPU: the weight dequantized by XLA ops inside the jitted step,
  which those compilers may fuse into the dot's operand;
- "pallas": a Pallas Triton kernel for NVIDIA GPUs (`pallas_kernels/quant_matmul_gpu.py`)
  that dequantizes each code in registers right before the tensor-core dot (XLA may instead
  write the float weight out first where it cannot fuse the int4 unpacking, a reshape and a
  concatenation). It has been checked in interpret mode and lowered for CUDA, never run on a
  GPU: it becomes "auto"'s choice there once `benchmarks/kernels/quant_matmul.py` shows it
  faster on one. Off the GPU it runs interpreted (for checking). Shapes it cannot tile (no
  power-of-two block dividing them), and fp8 on GPUs before compute capability 8.9, use the
  XLA ops. No Pallas TPU kernel: it would slice the `[O, G]` scales along lanes (16-lane slices
  of int4 codes at groups of 32), which Mosaic lays out poorly.
Under tensor parallelism a kernel's operands are gathered whole on each device (XLA cannot
split an FFI or Pallas call); the XLA ops split with the weight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import pallas_kernels
from jaxllm.config import kernel_choices
from pallas_kernels import quant_matmul_cpu, quant_matmul_gpu

FORMATS = ("int8", "int4", "fp8")
INT4_BLOCK = 32  # elements per packed int4 block (16 bytes)
# Elements per scale when quantizing to int4 here: llama.cpp's Q4 granularity. With float16
# scales and offsets that is 5 bits a weight. Measured on the demo model (held-out text,
# scripts/quant_quality.py): perplexity +0.1% at 32, +40% at AWQ's and GPTQ's 128.
INT4_GROUP = 32
_INT4_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
_INT4_REFINE_STEPS = 8  # least-squares refits of a group's scale and offset (`quantize`)
# The output head's importance of input d: |gamma_d| ** HEAD_IMPORTANCE_POWER, gamma the final
# norm's scale. A head row's logit error is sum_d gamma_d * x_d * dw_d (x the normalized
# hidden state), whose variance weights dw_d by gamma_d^2 E[x_d^2]; E[x_d^2] needs calibration
# data, and on the demo model it grows with |gamma_d|, so the weight is steeper than gamma^2.
# The power was picked on a development text (Python documentation topics other than those of
# the held-out text), all-int4 demo model: perplexity +5.7% at 2, +4.3% at 4, +3.2% at 8,
# +5.2% at 12; unweighted +7.4%.
HEAD_IMPORTANCE_POWER = 8
# int4 keeps the output head's rows of the most frequent tokens in int8 (`quantize_head`): a
# BPE vocabulary numbers its tokens in the order they were merged, the most frequent first
# (SentencePiece's by score), so its first ids are most of any text: 74-77% of the tokens of
# five texts of different kinds (prose, licence, code, documentation) for the demo model's
# first 4,096. Measured there (first 1,200 tokens of each, only the head quantized): the
# int4 head costs +2.3% to +5.2% perplexity, with these rows in int8 +1.4% to +1.9%, for
# 0.9 MB more (the whole model then 0.158x float32's bytes). The rows are at most an eighth
# of the vocabulary (a multiple of 32), for small vocabularies.
INT4_HEAD_INT8_ROWS = 4096
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448

# The parameters that may be quantized, by name (the last element of their path); mixture-of-
# experts weights share the names but have an "expert" axis, and stay float.
QUANTIZABLE = frozenset(
    (
        "q_proj",
        "q_a_proj",  # latent attention's (not kv_b_proj: absorbed into queries and outputs)
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
        "embed_tokens",
    )
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized matrix [O, I] that stands for a float parameter whose output axes are
    `out_shape` (see the module docstring). Leaves are jax or numpy arrays."""

    q: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray  # [O, G] float16 or float32
    offset: jax.Array | np.ndarray | None  # [O, G], scale's dtype
    fmt: str = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))  # of the float it replaces
    # i32[I]: the inputs in the order of q's columns, where a checkpoint's groups are not
    # contiguous (GPTQ act-order): x[:, perm] @ w.T. None: in order.
    perm: jax.Array | np.ndarray | None = None

    @property
    def num_out(self) -> int:
        return self.q.shape[0]

    @property
    def num_in(self) -> int:
        return self.q.shape[1] * (2 if self.fmt == "int4" else 1)

    @property
    def group_size(self) -> int:
        return self.num_in // self.scale.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        """[O, I]: the matrix it stands for, in its own (output-major) layout."""
        return (self.num_out, self.num_in)

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))

    def map_rows(self, fn) -> QArray:
        """The same weight with `fn` applied to the rows (axis 0) of q, scale and offset: a
        permutation or repetition of output channels."""
        return dataclasses.replace(
            self,
            q=fn(self.q),
            scale=fn(self.scale),
            offset=None if self.offset is None else fn(self.offset),
        )

    def with_output(self, out_shape: tuple[int, ...], dtype) -> QArray:
        if int(np.prod(out_shape)) != self.num_out:
            raise ValueError(f"{self.num_out} output rows cannot take the shape {out_shape}")
        return dataclasses.replace(self, out_shape=tuple(out_shape), dtype=np.dtype(dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitRows:
    """A quantized matrix [O, I] held as two QArrays by rows, each in its own format: `first`
    holds rows [0, n), `rest` the others. int4's output head (`quantize_head`); `qmatmul`,
    `take_rows` and the dequantizers take it as they take a QArray, and its output axis is
    one (the vocabulary)."""

    first: QArray
    rest: QArray

    @property
    def num_out(self) -> int:
        return self.first.num_out + self.rest.num_out

    @property
    def num_in(self) -> int:
        return self.first.num_in

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_out, self.num_in)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.num_out,)

    @property
    def dtype(self) -> np.dtype:
        return self.first.dtype

    @property
    def nbytes(self) -> int:
        return self.first.nbytes + self.rest.nbytes

    def with_output(self, out_shape: tuple[int, ...], dtype) -> SplitRows:
        if tuple(out_shape) != (self.num_out,):
            raise ValueError(f"{self.num_out} output rows split in two cannot take {out_shape}")
        return SplitRows(
            self.first.with_output((self.first.num_out,), dtype),
            self.rest.with_output((self.rest.num_out,), dtype),
        )


QUANTIZED = (QArray, SplitRows)  # what a quantized linear weight may be


# ---- packing ------------------------------------------------------------------------------


def pack_int4(values: np.ndarray) -> np.ndarray:
    """uint8 [O, I] of 0..15 -> uint8 [O, I / 2] in the block layout (I a multiple of 32)."""
    o, i = values.shape
    if i % INT4_BLOCK:
        raise ValueError(f"int4 needs an input width that is a multiple of 32, got {i}")
    blocks = values.astype(np.uint8).reshape(o, i // INT4_BLOCK, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(o, i // 2)


def unpack_int4(packed):
    """The inverse of `pack_int4`, for numpy or jax arrays: [O, I / 2] -> [O, I] of 0..15."""
    xp = jnp if isinstance(packed, jax.Array) else np
    o, half = packed.shape
    blocks = packed.reshape(o, half // 16, 16)
    return xp.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(o, half * 2)


def compact_factors(scale: np.ndarray, offset: np.ndarray | None):
    """A QArray's scale and offset on the host: float16 when that holds every value of both
    exactly (GGUF's and GPTQ's half-precision factors), else float32 (products such as
    K-quants' d * sc). Both always share one dtype, as the kernels require."""
    pair = [np.asarray(scale, np.float32)]
    if offset is not None:
        pair.append(np.asarray(offset, np.float32))
    if all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in pair):
        pair = [a.astype(np.float16) for a in pair]
    return pair[0], (pair[1] if offset is not None else None)


# ---- quantizing float weights (on the host, at load) ---------------------------------------


def quantize(
    w: np.ndarray,
    fmt: str,
    *,
    group_size: int | None = None,
    importance: np.ndarray | None = None,
) -> QArray:
    """A float matrix [O, I] (torch layout) quantized to `fmt`: int8 and fp8 per output
    channel (symmetric), int4 asymmetric per group of `group_size` inputs (default 32).
    `importance` (int4; f32[I], >= 0): how much an error in each input costs; each group's
    scale and offset are then refit to the least importance-weighted squared error
    (`_refine_int4`)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize takes a matrix [O, I], got shape {w.shape}")
    o, i = w.shape
    if fmt == "int8":
        scale = np.abs(w).max(axis=1, keepdims=True) / 127.0
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        return QArray(q, scale, None, "int8", (o,), np.dtype(np.float32))
    if fmt == "fp8":
        scale = np.abs(w).max(axis=1, keepdims=True) / FP8_MAX
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
        return QArray(q, scale, None, "fp8", (o,), np.dtype(np.float32))
    if fmt != "int4":
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if group_size is None:
        group_size = INT4_GROUP
    if i % group_size or group_size % INT4_BLOCK:
        raise ValueError(
            f"int4 group_size must be a multiple of 32 dividing the input width {i}, "
            f"got {group_size}"
        )
    g = w.reshape(o, i // group_size, group_size)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    # Each group's range is also tried shrunk (clipping its outliers), keeping whichever
    # reconstructs the group best in squared error: AWQ's clip search, on the range.
    best_err = np.full(lo.shape, np.inf, np.float32)
    best_lo, best_scale = lo, lo
    for shrink in _INT4_SHRINK:
        # Scales and offsets are stored as float16: round them first, fit the values to those.
        lo_s = (lo * shrink).astype(np.float16).astype(np.float32)
        scale = ((hi * shrink - lo_s) / 15.0).astype(np.float16).astype(np.float32)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        values = np.clip(np.rint((g - lo_s[..., None]) / scale[..., None]), 0, 15)
        err = np.square(values * scale[..., None] + lo_s[..., None] - g).sum(axis=-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_lo = np.where(better, lo_s, best_lo)
        best_scale = np.where(better, scale, best_scale)
    lo, scale = best_lo, best_scale
    values = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15)
    if importance is not None:
        c = np.asarray(importance, np.float32).reshape(1, i // group_size, group_size)
        scale, lo, values = _refine_int4(g, c, scale, lo, values)
    q = pack_int4(values.reshape(o, i).astype(np.uint8))
    return QArray(
        q, scale.astype(np.float16), lo.astype(np.float16), "int4", (o,), np.dtype(np.float32)
    )


def head_int8_rows(num_out: int) -> int:
    """How many of an int4 output head's first rows `quantize_head` keeps in int8."""
    return min(INT4_HEAD_INT8_ROWS, num_out // 8 // 32 * 32)


def quantize_head(w: np.ndarray, importance: np.ndarray | None = None) -> QArray | SplitRows:
    """int4's output head [V, D]: the rows of the most frequent tokens (the first
    `head_int8_rows`) in int8, the rest in int4 refit to `importance`
    (`INT4_HEAD_INT8_ROWS` says why)."""
    n = head_int8_rows(w.shape[0])
    if n == 0:
        return quantize(w, "int4", importance=importance)
    return SplitRows(quantize(w[:n], "int8"), quantize(w[n:], "int4", importance=importance))


def abstract_head(num_out: int, num_in: int) -> QArray | SplitRows:
    """The shapes `quantize_head` gives an int4 head, as `jax.ShapeDtypeStruct`s."""
    n = head_int8_rows(num_out)
    if n == 0:
        return abstract_qarray("int4", num_out, num_in)
    return SplitRows(
        abstract_qarray("int8", n, num_in), abstract_qarray("int4", num_out - n, num_in)
    )


def abstract_qarray(fmt: str, num_out: int, num_in: int) -> QArray:
    """The shapes and dtypes `quantize` gives a [num_out, num_in] matrix in `fmt`, as
    `jax.ShapeDtypeStruct`s: for compiling a quantized model without its weights."""
    if fmt in ("int8", "fp8"):
        q = jax.ShapeDtypeStruct(
            (num_out, num_in), jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
        )
        scale = jax.ShapeDtypeStruct((num_out, 1), jnp.float32)
        return QArray(q, scale, None, fmt, (num_out,), np.dtype(np.float32))
    if fmt != "int4":
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if num_in % INT4_GROUP:
        raise ValueError(
            f"int4 needs an input width that is a multiple of {INT4_GROUP}, got {num_in}"
        )
    q = jax.ShapeDtypeStruct((num_out, num_in // 2), jnp.uint8)
    scale = jax.ShapeDtypeStruct((num_out, num_in // INT4_GROUP), jnp.float16)
    return QArray(q, scale, scale, "int4", (num_out,), np.dtype(np.float32))


def _refine_int4(g, c, scale, lo, values):
    """Alternates, per group of `g` [O, G, S] with importance `c` [1, G, S]: the scale and
    offset minimizing sum c * (values * scale + lo - g)^2 for the values (weighted least
    squares, rounded to float16), then the values nearest for those (the best for any
    weights); keeps each group's best fit. Starts from `quantize`'s clip search."""

    def error(s, m, v):
        return (c * np.square(v * s[..., None] + m[..., None] - g)).sum(-1)

    best = error(scale, lo, values)
    n, cg = c.sum(-1), (c * g).sum(-1)
    for _ in range(_INT4_REFINE_STEPS):
        cv = c * values
        sv, svv, svw = cv.sum(-1), (cv * values).sum(-1), (cv * g).sum(-1)
        det = n * svv - sv * sv
        fit = det > 0  # the values of the group are not all equal
        s = np.where(fit, (n * svw - sv * cg) / np.where(fit, det, 1.0), scale)
        m = (cg - s * sv) / np.where(n > 0, n, 1.0)
        s = s.astype(np.float16).astype(np.float32)
        m = m.astype(np.float16).astype(np.float32)
        s = np.where(s > 0, s, scale)
        v = np.clip(np.rint((g - m[..., None]) / s[..., None]), 0, 15)
        err = error(s, m, v)
        better = err < best
        best = np.where(better, err, best)
        scale, lo = np.where(better, s, scale), np.where(better, m, lo)
        values = np.where(better[..., None], v, values)
    return scale, lo, values


def dequantize_np(w: QArray | SplitRows) -> np.ndarray:
    """f32[O, I] on the host (inputs in order), by the formula of the module docstring."""
    if isinstance(w, SplitRows):
        return np.concatenate([dequantize_np(w.first), dequantize_np(w.rest)])
    return _dequantize(jax.tree.map(np.asarray, w), np, np.float32)


def _dequantize(w: QArray, xp, dtype):
    """The formula of the module docstring with numpy or jax.numpy (`xp`), in float32,
    rounded to `dtype` last; columns back in input order where `perm` reordered them."""
    q = unpack_int4(w.q) if w.fmt == "int4" else w.q
    o, i = w.shape
    groups = w.scale.shape[1]
    out = q.astype(xp.float32).reshape(o, groups, i // groups)
    out = out * w.scale.astype(xp.float32)[..., None]
    if w.offset is not None:
        out = out + w.offset.astype(xp.float32)[..., None]
    out = out.reshape(o, i)
    if w.perm is not None:
        out = out[:, xp.argsort(w.perm)]
    return out.astype(dtype)


# ---- using them (inside the jitted step) ---------------------------------------------------


def dequantize(w: QArray | SplitRows, dtype=jnp.float32) -> jax.Array:
    """[O, I] in `dtype` (inputs in order), by XLA ops (float32 arithmetic, rounded to
    `dtype` last)."""
    if isinstance(w, SplitRows):
        return jnp.concatenate([dequantize(w.first, dtype), dequantize(w.rest, dtype)])
    return _dequantize(w, jnp, dtype)


def matmul_implementation() -> str:
    """ "native", "pallas" or "xla": `quant_matmul_backend`'s choice (of the kernel choices in
    force: `config.using_kernels`), "auto" resolved by platform.
    "pallas" is the Triton kernel: it runs on NVIDIA GPUs, and interpreted on the CPU (for
    checking); anywhere else it is refused rather than interpreted slowly."""
    backend = kernel_choices().quant_matmul_backend
    platform = pallas_kernels.current_platform()
    if backend == "pallas" and platform not in ("gpu", "cpu"):
        raise ValueError(
            f"quant_matmul_backend pallas is a Triton kernel for NVIDIA GPUs and cannot run on "
            f"{platform}; use auto or xla"
        )
    if backend != "auto":
        return backend
    if platform == "cpu":
        return "native" if quant_matmul_cpu.available() else "xla"
    return "xla"


def _pallas_runs(num_tokens: int, w: QArray) -> bool:
    """Whether the Pallas kernel takes this matmul: it tiles the shapes, and fp8 codes only on
    a GPU that converts e4m3 (compute capability 8.9 on; lowered off a GPU, JAX assumes 9.0)."""
    if not quant_matmul_gpu.supports(num_tokens, w.num_out, w.num_in, w.fmt):
        return False
    if w.fmt != "fp8" or pallas_kernels.current_platform() != "gpu":
        return True
    capability = pallas_kernels.compute_capability()
    return capability is None or capability >= (8, 9)


def _xla_matmul(x: jax.Array, w: QArray) -> jax.Array:
    return jax.lax.dot_general(
        x, dequantize(w, x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def qmatmul(x: jax.Array, w: QArray | SplitRows) -> jax.Array:
    """x [T, I] @ w.T -> f32[T, O]."""
    if isinstance(w, SplitRows):
        return jnp.concatenate([qmatmul(x, w.first), qmatmul(x, w.rest)], axis=-1)
    kernel = matmul_implementation()
    if kernel == "xla" or (kernel == "pallas" and not _pallas_runs(x.shape[0], w)):
        return _xla_matmul(x, w)
    if w.perm is not None:  # the kernels read q's columns in order
        x = jnp.take(x, w.perm, axis=1)
    if kernel == "native":
        return quant_matmul_cpu.quant_matmul_cpu(x, w.q, w.scale, w.offset, w.fmt)
    interpret = pallas_kernels.current_platform() != "gpu"
    return quant_matmul_gpu.quant_matmul_gpu(x, w.q, w.scale, w.offset, w.fmt, interpret=interpret)


def qmatmuls(x: jax.Array, ws: Sequence[QArray]) -> list[jax.Array]:
    """[x @ w.T for w in ws] (f32[T, O] each), the weights that share their format, group
    count, scale dtype and offsets in one native kernel call on the CPU: q, k and v of a layer
    (gate and up) then cost one call instead of three (two), one rounding of x and one spread
    over the threads (the demo model's 30 layers at T = 1: 5.4 -> 4.4 ms, 2-core AMD EPYC).
    Each result is bit for bit the weight's own `qmatmul`. Elsewhere: one qmatmul each."""
    if matmul_implementation() != "native" or len(ws) < 2:
        return [qmatmul(x, w) for w in ws]
    calls: dict[tuple, list[int]] = {}  # weights that may share a call -> their indices
    for i, w in enumerate(ws):
        key = (w.fmt, w.scale.shape[1], w.scale.dtype, w.offset is None)
        calls.setdefault(key if w.perm is None else (i,), []).append(i)  # perm: x reordered
    out: list[jax.Array | None] = [None] * len(ws)
    for indices in calls.values():
        if len(indices) == 1:
            out[indices[0]] = qmatmul(x, ws[indices[0]])
            continue
        matrices = [(ws[i].q, ws[i].scale, ws[i].offset) for i in indices]
        results = quant_matmul_cpu.quant_matmuls_cpu(x, matrices, ws[indices[0]].fmt)
        for i, r in zip(indices, results, strict=True):
            out[i] = r
    return out


def take_rows(w: QArray | SplitRows, ids: jax.Array) -> jax.Array:
    """Rows `ids` of the dequantized matrix, in w.dtype: an embedding lookup (only the rows
    asked for are dequantized)."""
    if isinstance(w, SplitRows):
        n = w.first.num_out
        first = take_rows(w.first, jnp.minimum(ids, n - 1))
        rest = take_rows(w.rest, jnp.maximum(ids - n, 0))
        return jnp.where((ids < n)[..., None], first, rest)
    return dequantize(w.map_rows(lambda a: a[ids]), w.dtype)


# ---- MXFP4 experts (gpt-oss's, kept as shipped) --------------------------------------------

MXFP4_BLOCK = 32  # values per shared power-of-two scale
# The 16 E2M1 codes' values (sign bit 3): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
MXFP4_SCALE_BIAS = 127  # a block's scale is 2^(byte - 127) (E8M0)


class _KeptExperts:
    """What experts kept as a checkpoint ships them share: leaves [E, O, ...] (each expert's
    output-major weight and its factors), standing for the float parameter [E, I, O]."""

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))

    def take(self, experts: jax.Array):
        """The experts `experts` (i32[R]) in that order: [R, ...] leaves."""
        return jax.tree.map(lambda a: a[experts], self)

    def specs(self, spec):
        """The PartitionSpecs of the leaves for a parameter split as `spec` (E, I, O): experts,
        outputs and inputs (whole groups: see `loaders.weights`) as the parameter's."""
        from jax.sharding import PartitionSpec as P

        e, i, o = tuple(spec) + (None,) * (3 - len(spec))
        return jax.tree.map(lambda _: P(e, o, i), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4Experts(_KeptExperts):
    """A mixture of experts' stacked projection kept in MXFP4, as gpt-oss ships it
    (loaders/mxfp4.py): `codes` u8[E, O, I / 2], two E2M1 codes a byte (input 2j in the low
    nibble, 2j + 1 in the high one: the checkpoint's `_blocks` with their last two axes
    merged), and `scales` u8[E, O, I / 32], one power of two per 32 inputs, standing for the
    float parameter [E, I, O] (input-major, the MoE's layout) in `dtype`. 4.25 bits a weight
    on the device; the MoE dequantizes each device's experts inside the step
    (`dequantize_half`), exactly: every MXFP4 value is a bfloat16."""

    codes: jax.Array | np.ndarray
    scales: jax.Array | np.ndarray
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        e, o, g = self.scales.shape
        return (e, g * MXFP4_BLOCK, o)

    def __getitem__(self, index) -> MXFP4Experts:
        """`w[..., outputs]`: the outputs a slice picks (the rows of codes and scales), as
        the loader splits a fused gate_up projection; nothing else can be indexed."""
        if not (
            isinstance(index, tuple)
            and len(index) == 2
            and index[0] is Ellipsis
            and isinstance(index[1], slice)
        ):
            raise TypeError(f"MXFP4 experts can only select outputs (w[..., a:b:c]), not {index}")
        rows = index[1]
        return dataclasses.replace(self, codes=self.codes[:, rows], scales=self.scales[:, rows])


def dequantize_half(w: MXFP4Experts, dtype, *, odd: bool) -> jax.Array:
    """The weights of the even inputs (or of the odd ones), [E, O, I / 2] in `dtype`
    (output-major, as stored): x @ w = x[:, 0::2] @ even.T + x[:, 1::2] @ odd.T. Elementwise
    XLA ops on arrays whose minor axis is wide, which the compilers fuse into one pass over
    the codes; interleaving the halves into [E, O, I] would put an axis of 2 minor-most,
    which XLA:TPU tiles as (8, 128) (3.2 GB of temporaries for gpt-oss-20b's 0.4 GB of
    experts in one layer), and a table lookup would be a gather it does not fuse. Exact: each
    E2M1 value's float32 bits are built from its code, then multiplied by its block's power
    of two."""
    e, o, g = w.scales.shape
    s = w.scales.astype(jnp.uint32)
    scale = jax.lax.bitcast_convert_type(
        jnp.where(s == 0, jnp.uint32(1 << 22), s << 23), jnp.float32
    )  # 2^(s - 127); 2^-127 is a subnormal
    scale = jnp.broadcast_to(scale[..., None], (e, o, g, MXFP4_BLOCK // 2)).reshape(e, o, -1)
    codes = w.codes.astype(jnp.uint32)
    codes = codes >> 4 if odd else codes & 15
    return (_e2m1_to_f32(codes) * scale).astype(dtype)


def _e2m1_to_f32(code: jax.Array) -> jax.Array:
    """The float32 values of E2M1 codes (u32, 0..15): sign bit 3, exponent bits 2-1 (bias 1),
    mantissa bit 0; exponent 0 is subnormal (0 or 0.5)."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    normal = exponent > 0
    f32_exponent = jnp.where(normal, exponent + 126, jnp.where(mantissa == 1, 126, 0))
    bits = ((code >> 3) << 31) | (f32_exponent << 23) | jnp.where(normal, mantissa << 22, 0)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Experts(_KeptExperts):
    """A mixture of experts' stacked projection kept in float8 e4m3, as a fine-grained FP8
    checkpoint ships it (DeepSeek-V3: one factor per 128 x 128 block): `q` f8[E, O, I] (each
    expert's [out, in] weight as stored) and `scale` f32[E, O, G], the factor of each output
    row's G groups of I / G inputs (a block's factor repeated over its rows, as the fp8
    QArrays of `loaders.quantized_hf.fp8_blocks` hold it), standing for the float parameter
    [E, I, O] in `dtype`. A byte a weight on the device (and 3% of it in factors); the MoE
    dequantizes each device's experts inside the step (`dequantize_experts`), exactly."""

    q: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        e, o, i = self.q.shape
        return (e, i, o)


# Experts a checkpoint ships quantized and the MoE keeps so, dequantizing them in the step.
KEPT_EXPERTS = (MXFP4Experts, FP8Experts)


def dequantize_experts(w: FP8Experts, dtype) -> jax.Array:
    """FP8 experts' weights, [E, O, I] in `dtype` (output-major, as stored)."""
    e, o, i = w.q.shape
    groups = w.scale.shape[-1]
    x = w.q.astype(jnp.float32).reshape(e, o, groups, i // groups) * w.scale[..., None]
    return x.reshape(e, o, i).astype(dtype)


def abstract_fp8_experts(shape: tuple[int, int, int], dtype, group: int) -> FP8Experts:
    """The leaves an [E, I, O] projection's FP8 experts have (groups of `group` inputs), as
    `jax.ShapeDtypeStruct`s: for compiling an FP8 checkpoint without its weights (`group` 0:
    one factor a row)."""
    e, i, o = shape
    group = math.gcd(group, i) if group else i
    return FP8Experts(
        jax.ShapeDtypeStruct((e, o, i), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((e, o, i // group), jnp.float32),
        np.dtype(dtype),
    )


def abstract_mxfp4_experts(shape: tuple[int, int, int], dtype) -> MXFP4Experts:
    """The leaves an [E, I, O] projection's MXFP4 experts have, as `jax.ShapeDtypeStruct`s:
    for compiling a gpt-oss checkpoint without its weights."""
    e, i, o = shape
    if i % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 experts need an input width that is a multiple of 32, got {i}")
    return MXFP4Experts(
        jax.ShapeDtypeStruct((e, o, i // 2), jnp.uint8),
        jax.ShapeDtypeStruct((e, o, i // MXFP4_BLOCK), jnp.uint8),
        np.dtype(dtype),
    )
