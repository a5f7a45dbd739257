"""MXFP4 (OCP Microscaling FP4), the format gpt-oss's expert weights ship in: each block of 32
values along a row shares one 8-bit power-of-two scale (E8M0: 2^(byte - 127)), and each value
is a 4-bit E2M1 float (one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two per byte, the low nibble
first.

A checkpoint holds a projection `P` of the stacked experts as `P_blocks` uint8
[E, out, in / 32, 16] and `P_scales` uint8 [E, out, in / 32] (output-major). As soon as both
halves have been read, one projection at a time:
- `kept_pairs` makes them one `quantization.MXFP4Experts` standing for `P` [E, in, out]: kept
  4-bit on the device (4.25 bits a weight) and dequantized inside the step, by default on
  accelerators (`loaders.mxfp4_kept`);
- `dequantize_pairs` turns them into the float `P` [E, in, out] (input-major, as transformers'
  `convert_moe_packed_tensors` does: the layout of gpt-oss's float checkpoints) in the model's
  dtype: exact (every MXFP4 value is a bfloat16), at 4x the shipped bytes on the device, the
  host never holding more than one projection in float. The CPU's default: XLA's CPU backend
  would dequantize every expert on every step, and no native kernel reads E2M1 codes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from jaxllm.quantization import E2M1_VALUES, MXFP4Experts
from jaxllm.quantization import MXFP4_BLOCK as BLOCK
from jaxllm.quantization import MXFP4_SCALE_BIAS as _SCALE_BIAS

_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """f32[..., G * 32] from `blocks` uint8 [..., G, 16] and `scales` uint8 [..., G]."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales, np.uint8)
    _check_shapes(blocks, scales)
    values = np.stack([E2M1_VALUES[blocks & 0x0F], E2M1_VALUES[blocks >> 4]], axis=-1)
    values = values.reshape(*scales.shape, BLOCK)
    exponent = scales.astype(np.int32) - _SCALE_BIAS
    values = np.ldexp(values, exponent[..., None]).astype(np.float32)
    return values.reshape(*scales.shape[:-1], -1)


def _check_shapes(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree (blocks "
            f"must be [..., G, {BLOCK // 2}] and scales [..., G])"
        )


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]) of `w` [..., K] (K a
    multiple of 32): each block's scale is the smallest power of two that brings its largest
    magnitude within 6 (E2M1's largest value: 2^ceil(log2(amax / 6)), as triton_kernels'
    `downcast_to_mxfp` rounds, never saturating where the OCP spec's floor(log2(amax)) - 2
    would clip up to a third of the block's top), each value the nearest E2M1 value of
    w / scale (ties to the lower magnitude)."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last axis a multiple of {BLOCK}, got {w.shape[-1]}")
    groups = w.reshape(*w.shape[:-1], -1, BLOCK)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 6)), -_SCALE_BIAS)
    exponent = np.clip(exponent, -_SCALE_BIAS, _SCALE_BIAS).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1), exponent)[..., None]
    magnitudes = E2M1_VALUES[:8]
    nearest = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(axis=-1)  # ties: lower code
    codes = (nearest + 8 * (scaled < 0)).astype(np.uint8)
    codes = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    # C order whatever w's was (a transposed view gives strided results, which e.g.
    # safetensors would write in the wrong order).
    scales = (exponent + _SCALE_BIAS).astype(np.uint8)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(scales)


def _paired(
    tensors: Iterable[tuple[str, np.ndarray]],
) -> Iterator[tuple[str, np.ndarray, np.ndarray | None]]:
    """(name, tensor, None) for other tensors, and (stem, blocks, scales) for each
    `P_blocks` / `P_scales` pair when its second half arrives."""
    pending: dict[str, tuple[str, np.ndarray]] = {}
    for name, tensor in tensors:
        part = _BLOCKS if name.endswith(_BLOCKS) else _SCALES if name.endswith(_SCALES) else None
        if part is None:
            yield name, tensor, None
            continue
        stem = name[: -len(part)]
        other = pending.pop(stem, None)
        if other is None:
            pending[stem] = (part, np.asarray(tensor))
            continue
        halves = {part: np.asarray(tensor), other[0]: other[1]}
        blocks, scales = halves[_BLOCKS], halves[_SCALES]
        try:
            _check_shapes(blocks, scales)
        except ValueError as e:
            raise ValueError(f"tensor {stem!r}: {e}") from e
        yield stem, blocks, scales
    if pending:
        stem, (part, _) = next(iter(pending.items()))
        missing = _SCALES if part == _BLOCKS else _BLOCKS
        raise ValueError(f"MXFP4 tensor {stem + part!r} has no {stem + missing!r}")


def dequantize_pairs(
    tensors: Iterable[tuple[str, np.ndarray]], dtype=ml_dtypes.bfloat16
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) pairs with each `P_blocks` / `P_scales` pair replaced by the float `P`
    [E, in, out] in `dtype`, yielded when its second half arrives; other tensors pass."""
    for stem, blocks, scales in _paired(tensors):
        if scales is None:
            yield stem, blocks
            continue
        # One expert at a time: float32 temporaries of one expert, not of the stack (a
        # gpt-oss-120b projection is 2.1G values).
        w = np.empty((*scales.shape[:-2], scales.shape[-1] * BLOCK, scales.shape[-2]), dtype)
        for e in np.ndindex(*scales.shape[:-2]):
            w[e] = dequantize(blocks[e], scales[e]).T.astype(dtype)  # [in, out]
        yield stem, w


def kept_pairs(
    tensors: Iterable[tuple[str, np.ndarray]],
) -> Iterator[tuple[str, np.ndarray | MXFP4Experts]]:
    """(name, tensor) pairs with each `P_blocks` / `P_scales` pair replaced by one
    `MXFP4Experts` standing for `P` [E, in, out] (float32 until `build_state` gives it the
    model's dtype); other tensors pass."""
    for stem, blocks, scales in _paired(tensors):
        if scales is None:
            yield stem, blocks
        elif blocks.ndim != 4:
            raise ValueError(
                f"tensor {stem!r}: MXFP4 experts must be [experts, out, in / 32, 16], got "
                f"{list(blocks.shape)}"
            )
        else:
            codes = blocks.reshape(*blocks.shape[:2], -1)  # [E, out, in / 2]
            yield stem, MXFP4Experts(codes, scales, np.dtype(np.float32))
