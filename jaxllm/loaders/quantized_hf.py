"""Pre-quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors, FP8) read into QArrays
(jaxllm/quantization.py) without a float round trip.

A quantized linear layer is several tensors under one module name (`...q_proj.qweight`,
`.qzeros`, `.scales`, ...). `group_quantized` collects them and yields one
`(module + ".weight", QArray)` in their place; every other tensor passes through. The formats,
as their writers pack them:

- GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`): `qweight` int32 [I / 8, O], eight 4-bit
  values of consecutive input rows per int32, lowest bits first (bits 8: four per int32);
  `qzeros` int32 [G, O / 8], packed the same way along the outputs; `scales` float16 [G, O];
  `g_idx` int32 [I], each input row's group (act-order: not i // group_size). The original
  checkpoint format ("gptq", v1) stores each zero point minus one: w = s * (q - (z + 1));
  "gptq_v2" stores it as is. Act-order rows are sorted by group here, so that groups are
  contiguous as a QArray needs, and the QArray carries the permutation for its inputs.
- AWQ (AutoAWQ GEMM, `quant_method: awq`): `qweight` int32 [I, O / 8] packed along the
  outputs in the order [0, 2, 4, 6, 1, 3, 5, 7] (output column 8c + order[k] in nibble k);
  `qzeros` int32 [G, O / 8] the same; `scales` float16 [G, O]; w = s * (q - z).
- MXFP4 (`quant_method: mxfp4`, gpt-oss): the experts' `*_blocks` and `*_scales`, kept 4-bit
  or dequantized to float at load (`mxfp4.py`).
- Fine-grained FP8 (`quant_method: fp8`: DeepSeek-V3, Qwen3's and others' "-FP8"
  checkpoints, transformers' `FineGrainedFP8Config`): `weight` float8 e4m3 [O, I] with
  `weight_scale_inv` float32 (or UE8M0) [ceil(O / bo), ceil(I / bi)], one factor per block of
  `weight_block_size` [bo, bi] (a last partial block keeps its own), or a single factor
  without a block size; w = weight * scale. Kept as an fp8 QArray whose groups divide both the
  block and the row (exact), streamed: a module goes as soon as its two tensors have come.
  Layers the checkpoint left in float (`modules_to_not_convert`) pass.
- compressed-tensors (`quant_method: compressed-tensors`): int8 (`int-quantized`,
  `naive-quantized`) or float8 e4m3 (`float-quantized`) `weight` [O, I] with `weight_scale` per
  tensor, channel or group (and `weight_zero_point` when asymmetric); `pack-quantized` 4-bit
  `weight_packed` int32 [O, I / 8] (values stored + 8) with `weight_scale` [O, G]. Activation
  scales (`input_scale`, W8A8 checkpoints) are not used: layers run weight-only, with float
  activations.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from jaxllm.loaders import mxfp4
from jaxllm.quantization import MXFP4Experts, QArray, compact_factors, pack_int4

logger = logging.getLogger(__name__)

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k holds output column order[k]
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "mxfp4": (),  # gpt-oss's experts: `mxfp4.dequantize_pairs`
    "fp8": (),  # streamed by `_fp8_modules`
    "compressed-tensors": (
        "weight",
        "weight_scale",
        "weight_zero_point",
        "weight_packed",
        "weight_shape",
        "weight_g_idx",
        "input_scale",
        "input_zero_point",
    ),
}
METHODS = tuple(_PARTS)


def checkpoint_method(hf_config: dict) -> str | None:
    """The checkpoint's quantization method (None for a float checkpoint); a clear error for
    one we cannot load."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported; supported: "
            f"{', '.join(METHODS)} (and GGUF files)"
        )
    return method


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] holding 32 / bits values per element along the rows -> [R * 32 / bits, C]."""
    per = 32 // bits
    shifts = (bits * np.arange(per, dtype=np.uint32))[None, :, None]
    values = (packed.astype(np.uint32)[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
    return values.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 [R, C] holding 32 / bits values per element along the columns -> [R, C * 32 / bits];
    `order[k]` is the column (within each element's run) of the k-th value from the lowest bits."""
    per = 32 // bits
    shifts = bits * np.arange(per, dtype=np.uint32)
    values = (packed.astype(np.uint32)[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    if order is not None:
        values = values[:, :, np.argsort(order)]
    return values.reshape(packed.shape[0], packed.shape[1] * per)


def _from_levels(values: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int, perm=None):
    """QArray for w[o, i] = scale[o, g] * (values[o, i] - zero[o, g]), unsigned `values`
    [O, I] of `bits` bits, contiguous groups along I."""
    o, i = values.shape
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit weights are not supported (4 and 8 are)")
    if bits == 4 and (i // scale.shape[1]) % 32 == 0:
        scale, offset = compact_factors(scale, -(zero * scale))
        q, fmt = pack_int4(values.astype(np.uint8)), "int4"
    else:  # in int8, shifted for 8 bits: s * (q - z) = s * ((q - 128) - (z - 128)); 4-bit
        # values in groups finer than int4's 32-blocks are stored as they are
        shift = 128 if bits == 8 else 0
        scale, offset = compact_factors(scale, -((zero - shift) * scale))
        q, fmt = (values.astype(np.int16) - shift).astype(np.int8), "int8"
    return QArray(q, scale, offset, fmt, (o,), np.dtype(np.float32), perm)


def gptq(parts: dict[str, np.ndarray], qc: dict) -> QArray:
    bits = int(qc.get("bits", 4))
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (gptq and gptq_v2 are)"
        )
    q = unpack_rows(parts["qweight"], bits)  # [I, O]
    zeros = unpack_cols(parts["qzeros"], bits)  # [G, O]
    if checkpoint_format == "gptq":  # v1 stores each zero point minus one
        zeros = zeros + 1
    scales = parts["scales"].astype(np.float32)  # [G, O]
    num_in, groups = q.shape[0], scales.shape[0]
    g_idx = parts.get("g_idx")
    g_idx = np.arange(num_in) // (num_in // groups) if g_idx is None else g_idx.astype(np.int64)
    perm = np.argsort(g_idx, kind="stable")
    if np.bincount(g_idx, minlength=groups).tolist() != [num_in // groups] * groups:
        raise ValueError("GPTQ g_idx does not give every group the same number of rows")
    perm = None if (perm == np.arange(num_in)).all() else perm.astype(np.int32)
    if perm is not None:
        q = q[perm]
    return _from_levels(q.T, scales.T, zeros.T.astype(np.float32), bits, perm)


def awq(parts: dict[str, np.ndarray], qc: dict) -> QArray:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (gemm is)")
    if bits != 4:
        raise ValueError(f"AWQ with {bits} bits is not supported (4 is)")
    q = unpack_cols(parts["qweight"], bits, _AWQ_ORDER)  # [I, O]
    zeros = unpack_cols(parts["qzeros"], bits, _AWQ_ORDER)  # [G, O]
    scales = parts["scales"].astype(np.float32)
    return _from_levels(q.T, scales.T, zeros.T.astype(np.float32), bits)


def _num_bits(qc: dict) -> int:
    """The weights' bit width of a compressed-tensors config (its first config group)."""
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if "num_bits" in weights:
            return int(weights["num_bits"])
    return 4


def compressed_tensors(parts: dict[str, np.ndarray], qc: dict) -> QArray | np.ndarray:
    if "weight_scale" not in parts:
        return parts["weight"]  # a layer the checkpoint left in float ("ignore")
    if "weight_g_idx" in parts:
        raise ValueError("compressed-tensors act-order (weight_g_idx) is not supported yet")
    scale = np.asarray(parts["weight_scale"], np.float32)
    zero = parts.get("weight_zero_point")
    if "weight_packed" in parts:
        bits = _num_bits(qc)
        if bits != 4 or zero is not None:
            raise ValueError(
                f"compressed-tensors pack-quantized weights of {bits} bits"
                f"{' with zero points' if zero is not None else ''} are not supported (4-bit "
                "symmetric is)"
            )
        o, i = (int(v) for v in np.asarray(parts["weight_shape"]).reshape(-1))
        values = unpack_rows(parts["weight_packed"].T, 4)[:i].T  # [O, I], stored q + 8
        scale = np.broadcast_to(scale.reshape(o, -1), (o, scale.size // o))
        return _from_levels(values, scale, np.full(scale.shape, 8, np.float32), 4)
    w = parts["weight"]
    o = w.shape[0]
    scale = scale.reshape(1, 1) if scale.size == 1 else scale.reshape(o, -1)
    scale = np.ascontiguousarray(np.broadcast_to(scale, (o, scale.shape[1])))
    if w.dtype == ml_dtypes.float8_e4m3fn:
        if zero is not None:
            raise ValueError("compressed-tensors fp8 with zero points is not supported")
        return QArray(w, scale, None, "fp8", (o,), np.dtype(np.float32))
    if w.dtype != np.int8:
        raise ValueError(f"compressed-tensors weight of dtype {w.dtype} is not supported")
    offset = None
    if zero is not None:
        zero = np.asarray(zero, np.float32)
        zero = zero.reshape(1, 1) if zero.size == 1 else zero.reshape(o, -1)
        offset = -zero * scale
    scale, offset = compact_factors(scale, offset)
    return QArray(w, scale, offset, "int8", (o,), np.dtype(np.float32))


def group_quantized(
    tensors: Iterable[tuple[str, np.ndarray]], method: str, qc: dict, *, keep_mxfp4: bool = True
) -> Iterator[tuple[str, np.ndarray | QArray | MXFP4Experts]]:
    """(name, tensor) pairs with each quantized module's tensors replaced by one
    (module.weight, QArray). Parts are collected to the end (a module's tensors may sit in
    different shards); the host then holds the quantized weights once, their final size.
    MXFP4 experts (the rest of such a checkpoint is float) become `MXFP4Experts`, or float
    where not `keep_mxfp4`."""
    if method == "mxfp4":
        yield from (mxfp4.kept_pairs if keep_mxfp4 else mxfp4.dequantize_pairs)(tensors)
        return
    if method == "fp8":
        yield from _fp8_modules(tensors, qc)
        return
    parts_of = _PARTS[method]
    modules: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in parts_of:
            modules.setdefault(prefix, {})[suffix] = np.asarray(tensor)
        else:
            yield name, tensor
    convert = {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors}[method]
    for prefix, parts in modules.items():
        parts = {k: v for k, v in parts.items() if k not in ("input_scale", "input_zero_point")}
        needed = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales")}
        missing = [p for p in needed.get(method, ()) if p not in parts]
        if method == "compressed-tensors" and not ({"weight", "weight_packed"} & set(parts)):
            missing = ["weight or weight_packed"]
        if missing:
            raise ValueError(f"{method} module {prefix!r} lacks {', '.join(missing)}")
        try:
            yield f"{prefix}.weight", convert(parts, qc)
        except ValueError as e:
            raise ValueError(f"{method} module {prefix!r}: {e}") from e


def fp8_blocks(w: np.ndarray, scale: np.ndarray, block: list[int] | None) -> QArray:
    """The fp8 QArray of `w` float8 e4m3 [O, I] scaled per block of `block` [bo, bi] by
    `scale` [ceil(O / bo), ceil(I / bi)] (per tensor without a block). Its groups are
    gcd(bi, I) inputs wide, so each lies inside one block, a last partial one included."""
    if w.dtype != ml_dtypes.float8_e4m3fn or w.ndim != 2:
        raise ValueError(f"fp8 weights must be float8_e4m3fn [out, in], got {w.dtype} {w.shape}")
    o, i = w.shape
    scale = np.asarray(scale, np.float32)
    if block is None:
        if scale.size != 1:
            raise ValueError(f"weight_scale_inv of shape {scale.shape} without a block size")
        return QArray(w, np.full((o, 1), scale.item(), np.float32), None, "fp8", (o,), _F32)
    bo, bi = (int(b) for b in block)
    blocks = (-(-o // bo), -(-i // bi))
    if scale.shape != blocks:
        raise ValueError(
            f"weight_scale_inv of shape {list(scale.shape)} for a weight of {[o, i]} in blocks "
            f"of {[bo, bi]}: expected {list(blocks)}"
        )
    group = math.gcd(bi, i)
    scale = np.repeat(np.repeat(scale, bo, axis=0)[:o], bi // group, axis=1)[:, : i // group]
    scale, _ = compact_factors(np.ascontiguousarray(scale), None)
    return QArray(w, scale, None, "fp8", (o,), _F32)


_F32 = np.dtype(np.float32)


def _fp8_modules(
    tensors: Iterable[tuple[str, np.ndarray]], qc: dict
) -> Iterator[tuple[str, np.ndarray | QArray]]:
    """(name, tensor) pairs with each fp8 module's `weight` and `weight_scale_inv` replaced by
    one (module.weight, QArray) as soon as both have come; other tensors pass at once."""
    block = qc.get("weight_block_size")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        logger.info("fp8 checkpoint: activation scales are not used (weights only)")
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        fp8 = getattr(tensor, "dtype", None) == ml_dtypes.float8_e4m3fn
        if fp8 and suffix != "weight":
            raise ValueError(
                f"fp8 tensor {name!r} is not a linear layer's weight (fused experts?), which "
                "fp8 checkpoints may only quantize here"
            )
        if not fp8 and suffix != "weight_scale_inv":
            if suffix != "input_scale":  # static activation scales: unused
                yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = np.asarray(tensor)
        if len(parts) == 2:
            del pending[prefix]
            try:
                yield (
                    f"{prefix}.weight",
                    fp8_blocks(parts["weight"], parts["weight_scale_inv"], block),
                )
            except ValueError as e:
                raise ValueError(f"fp8 module {prefix!r}: {e}") from e
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = "weight_scale_inv" if "weight" in parts else "float8 e4m3 weight"
        raise ValueError(f"fp8 module {prefix!r} has no {missing}")
