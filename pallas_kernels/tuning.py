"""Block sizes for the Pallas attention kernels, looked up by device and shape.

The key of `_TABLE` is `(backend, device, head_dim, page_size)`:
- `backend`: "pallas_tpu" or "pallas_gpu";
- `device`: a family name matched against `jax.Device.device_kind` lower-cased ("v5 lite" and
  "v5e" are TPU v5e, "v6 lite" and "v6e" are v6e, "v5p" or a bare "v5" is v5p, "h100", "h200";
  "cpu" is interpret mode), or "*" for any device;
- `head_dim` and `page_size`: exact values, or None for any.
The most specific entry wins (device, then head_dim, then page_size). An entry gives the
query block (`q_block`: query tokens per TPU grid step; the most query tokens per GPU program),
the KV block in tokens (`kv_tokens`, turned into whole pages) and, for Triton, warps and
pipeline stages.

Provenance: the H200 rows were measured on an H200 with `benchmarks/kernels/tune_attention.py`
(the H100 takes them: the same chip, and its own sweep agrees). The TPU entries and the GPU fallback ("*") are starting
points reasoned from the hardware (TPU: 512-token KV blocks keep a double-buffered block of one
layer's K/V for 8 kv heads x 128 dims at 2 x 2 MiB of VMEM in bf16, and 32 query tokens give
the MXU 32 x G rows; GPU: 64-token KV blocks keep the Triton program's `[rows, kv]` scores and
`[rows, H]` accumulator in registers): replace them with measured rows, one per device and
shape, from that sweep. An entry's `decode` sizes apply where every request has one query. The "cpu"
entries only make interpret mode fast: fewer, larger blocks.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.target import current_device_kind


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    q_block: int  # query tokens per block
    kv_pages: int  # KV pages per block
    num_warps: int = 4  # Triton only
    num_stages: int = 2  # Triton only
    num_splits: int = 1  # Triton only: shares of a program's KV blocks run apart (split-KV)


@dataclasses.dataclass(frozen=True)
class _Entry:
    q_block: int
    kv_tokens: int
    num_warps: int = 4
    num_stages: int = 2
    # (kv_tokens, num_warps, num_stages) for a decode call (one query per request), where
    # they differ: there a program streams one sequence's pages with a few query rows, and
    # longer KV blocks with more warps keep more loads in flight.
    decode: tuple[int, int, int] | None = None


_TABLE: dict[tuple[str, str, int | None, int | None], _Entry] = {
    ("pallas_tpu", "*", None, None): _Entry(q_block=32, kv_tokens=512),
    ("pallas_tpu", "v5e", None, None): _Entry(q_block=32, kv_tokens=512),
    ("pallas_tpu", "v6e", None, None): _Entry(q_block=64, kv_tokens=512),
    ("pallas_tpu", "v5p", None, None): _Entry(q_block=64, kv_tokens=512),
    ("pallas_tpu", "cpu", None, None): _Entry(q_block=64, kv_tokens=256),
    ("pallas_gpu", "*", None, None): _Entry(q_block=16, kv_tokens=64),
    ("pallas_gpu", "cpu", None, None): _Entry(q_block=32, kv_tokens=256),
}
# By head_dim, measured on an H200 (benchmarks/results/gpu-h200-tune.json, bfloat16, page size
# 16; against the entries before, which were reasoned: 8B decode 1.40x and 1.79x faster, 8B
# prefill 1.12x, head_dim 256 decode 1.04x, head_dim 64 decode 1.05x). The H100, the same SM90
# chip with slower memory, takes the same rows: its own sweep (gpu-h100-tune.json) found them
# fastest at four of the five shapes and within 11% at the fifth, the smallest worst case over
# both 8B decode shapes of all candidates.
_HOPPER = {
    128: _Entry(32, 32, 4, 3, decode=(256, 8, 2)),
    256: _Entry(16, 64, 4, 3, decode=(64, 4, 3)),
    64: _Entry(16, 64, 4, 2, decode=(256, 4, 2)),
}
_TABLE |= {
    ("pallas_gpu", family, head_dim, None): entry
    for family in ("h200", "h100")
    for head_dim, entry in _HOPPER.items()
}

# Split-KV on a GPU (`ragged_attention_gpu`): a decode call whose programs (requests x kv
# heads) are fewer than `_SPLIT_PROGRAMS` by family splits each program's KV blocks into the
# power of two of shares (at most `_MAX_SPLITS`) that brings them up to it: twice the SMs (132
# on an H100 and H200), so that each SM has a program to run while another waits on memory. A
# starting point reasoned from the hardware, not yet measured: replace it with the sweep's
# (benchmarks/kernels/tune_attention.py --splits) once a GPU is lent.
_SPLIT_PROGRAMS = {"h100": 264, "h200": 264, "a100": 216, "*": 0}
_MAX_SPLITS = 16


def decode_splits(family: str, num_programs: int) -> int:
    """Shares per program for a decode call of `num_programs` programs (requests x kv heads)
    on a GPU `family`: 1 where there are enough programs (or the family is unknown)."""
    target = _SPLIT_PROGRAMS.get(family, _SPLIT_PROGRAMS["*"])
    splits = 1
    while splits < _MAX_SPLITS and num_programs * splits * 2 <= target:
        splits *= 2
    return splits


_DEVICE_FAMILIES = (  # (substring of device_kind, family), first match wins
    ("v5 lite", "v5e"),
    ("v5e", "v5e"),
    ("v6 lite", "v6e"),
    ("v6e", "v6e"),
    ("v5p", "v5p"),
    ("v5", "v5p"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("a100", "a100"),
    ("cpu", "cpu"),
)


def device_family(device_kind: str | None = None) -> str:
    """The table's device name for a `device_kind` (default: the first device's)."""
    kind = (device_kind if device_kind is not None else current_device_kind()).lower()
    for needle, family in _DEVICE_FAMILIES:
        if needle in kind:
            return family
    return "*"


# The shared memory one Triton program may opt into, by GPU family (bytes): Hopper's 227 KiB,
# Ampere A100's 163 KiB, and the 99 KiB of Ada and consumer Ampere for anything else.
_GPU_SHARED_MEMORY = {"h100": 232448, "h200": 232448, "a100": 166912, "*": 101376}


def gpu_shared_memory(
    sizes: BlockSizes,
    *,
    page_size: int,
    head_dim: int,
    group: int,
    kv_itemsize: int,
    q_itemsize: int,
    hopper: bool | None = True,
    exact_float32: bool = False,
) -> int:
    """An upper estimate of the shared memory the Triton kernel's program takes, fitted to
    what XLA:GPU's Triton asks for on an H100 (tests/test_accelerator_compile.py checks it
    against the compiler): the query block, and the [kv, 2H] K/V tile, in the dots' dtype (the
    cache's; q's for an 8-bit cache, which is widened to it). Pipeline stages add nothing (the
    pages are gathered through registers, not copied in asynchronously). On Hopper a block of
    64 rows or more runs its dots as wgmma, which reads its second operand from shared memory:
    the K/V tile is there twice. Fewer rows (a decode block) use mma.sync, which stages the
    [rows, kv] probabilities instead. `hopper` None (a GPU not known): the larger of the two.
    `exact_float32` (float32 dots in IEEE float32, `exact_float32_dots()`): Triton runs them
    on the FMA units with the K/V tile twice at any row count; a decode block of the demo
    model's shape in float32 under JAX's "highest" precision asked an H100 for 260 KiB."""
    item = q_itemsize if kv_itemsize == 1 else kv_itemsize
    group_padded = 1 << (group - 1).bit_length()
    rows = max(sizes.q_block * group_padded, 16)
    kv = sizes.kv_pages * page_size
    tile = kv * 2 * head_dim * item
    staged = tile + rows * kv * item
    if exact_float32 and item == 4:
        staged = 2 * tile
    elif hopper is not False and rows >= 64:
        staged = 2 * tile if hopper else max(staged, 2 * tile)
    return staged + rows * head_dim * item + 1024  # 1 KiB: the compiler's own scratch


def exact_float32_dots() -> bool:
    """Whether JAX's default matmul precision in force (`jax.default_matmul_precision`, which
    the kernel's dots take) makes float32 dots exact IEEE float32 ("highest", "float32",
    "F32_F32_F32"), rather than TF32 or bfloat16 passes. Unknown algorithm presets count as
    exact: the estimate they feed must not fall short."""
    setting = jax.config.jax_default_matmul_precision
    if setting is None:
        return False
    try:
        return jax.lax.Precision(setting) == jax.lax.Precision.HIGHEST
    except ValueError:
        name = str(setting).upper()
        return not (name.startswith(("BF16_BF16_F32", "TF32_TF32_F32")) and "_X" not in name)


def _fit_gpu(sizes: BlockSizes, limit: int, **shape) -> BlockSizes:
    """Halves the KV block, then the query block, until the program's shared memory fits
    `limit` (head_dim 256 with 16-token query blocks did not fit an H100)."""
    while gpu_shared_memory(sizes, **shape) > limit:
        if sizes.kv_pages > 1 and sizes.kv_pages * shape["page_size"] > 16:
            sizes = dataclasses.replace(sizes, kv_pages=sizes.kv_pages // 2)
        elif sizes.q_block > 1:
            sizes = dataclasses.replace(sizes, q_block=sizes.q_block // 2)
        else:
            break
    return sizes


def get_block_sizes(
    backend: str,
    *,
    head_dim: int,
    page_size: int,
    num_tokens: int,
    max_reqs: int,
    device_kind: str | None = None,
    group: int = 1,
    kv_itemsize: int = 2,
    q_itemsize: int = 2,
    exact_float32: bool = False,
    num_kv_heads: int = 0,
) -> BlockSizes:
    """Block sizes for one call shape on the current device (or `device_kind`). `group` (query
    heads per kv head), the itemsizes of the cache and the queries and whether float32 dots are
    exact (`exact_float32_dots()`) size the GPU program's shared memory, which the sizes are cut
    down to fit; `num_kv_heads` (per device) with `max_reqs` counts a GPU decode's programs,
    which decide its split-KV shares (0: no split)."""
    family = device_family(device_kind)
    entry = None
    for key in (
        (backend, family, head_dim, page_size),
        (backend, family, head_dim, None),
        (backend, family, None, None),
        (backend, "*", head_dim, None),
        (backend, "*", None, None),
    ):
        if key in _TABLE:
            entry = _TABLE[key]
            break
    if entry is None:
        raise ValueError(f"no block sizes for backend {backend!r}")
    mean_q = -(-num_tokens // max(max_reqs, 1))
    kv_tokens, num_warps, num_stages = entry.kv_tokens, entry.num_warps, entry.num_stages
    if mean_q == 1 and entry.decode is not None:
        kv_tokens, num_warps, num_stages = entry.decode
    kv_pages = max(1, kv_tokens // page_size)
    # A work item (a GPU program, a TPU grid step) serves one request's block of queries, so a
    # block longer than the batch's mean query length is mostly padding (a decode batch has
    # one token per request). Powers of two: Triton's block shapes must be.
    q_block = min(entry.q_block, 1 << (mean_q - 1).bit_length())
    kv_pages = 1 << (kv_pages.bit_length() - 1)
    sizes = BlockSizes(q_block, kv_pages, num_warps, num_stages)
    if backend == "pallas_gpu" and family != "cpu":
        limit = _GPU_SHARED_MEMORY.get(family, _GPU_SHARED_MEMORY["*"])
        hopper = {"h100": True, "h200": True, "a100": False}.get(family)
        shape = dict(page_size=page_size, head_dim=head_dim, group=group, hopper=hopper)
        shape |= dict(kv_itemsize=kv_itemsize, q_itemsize=q_itemsize, exact_float32=exact_float32)
        sizes = _fit_gpu(sizes, limit, **shape)
        if mean_q == 1 and num_kv_heads:
            splits = decode_splits(family, max_reqs * num_kv_heads)
            sizes = dataclasses.replace(sizes, num_splits=splits)
    return sizes
