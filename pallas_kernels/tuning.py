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

Provenance: no TPU or GPU was available where these were chosen, so the accelerator entries are
starting points reasoned from the hardware (TPU: 512-token KV blocks keep a double-buffered
block of one layer's K/V for 8 kv heads x 128 dims at 2 x 2 MiB of VMEM in bf16, and 32 query
tokens give the MXU 32 x G rows; GPU: 64-token KV blocks keep the Triton program's
`[rows, kv]` scores and `[rows, H]` accumulator in registers). Replace them with measured
values from `benchmarks/kernels/ragged_attention.py`, one row per device and shape. The "cpu"
entries only make interpret mode fast: fewer, larger blocks.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.target import current_device_kind


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    q_block: int  # query tokens per block
    kv_pages: int  # KV pages per block
    num_warps: int = 4  # Triton only
    num_stages: int = 2  # Triton only


@dataclasses.dataclass(frozen=True)
class _Entry:
    q_block: int
    kv_tokens: int
    num_warps: int = 4
    num_stages: int = 2


_TABLE: dict[tuple[str, str, int | None, int | None], _Entry] = {
    ("pallas_tpu", "*", None, None): _Entry(q_block=32, kv_tokens=512),
    ("pallas_tpu", "v5e", None, None): _Entry(q_block=32, kv_tokens=512),
    ("pallas_tpu", "v6e", None, None): _Entry(q_block=64, kv_tokens=512),
    ("pallas_tpu", "v5p", None, None): _Entry(q_block=64, kv_tokens=512),
    ("pallas_tpu", "cpu", None, None): _Entry(q_block=64, kv_tokens=256),
    ("pallas_gpu", "*", None, None): _Entry(q_block=16, kv_tokens=64),
    ("pallas_gpu", "h100", 128, None): _Entry(q_block=16, kv_tokens=64, num_warps=4, num_stages=3),
    ("pallas_gpu", "h200", 128, None): _Entry(q_block=16, kv_tokens=64, num_warps=4, num_stages=3),
    ("pallas_gpu", "cpu", None, None): _Entry(q_block=32, kv_tokens=256),
}

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
    sizes: BlockSizes, *, page_size: int, head_dim: int, group: int, kv_itemsize: int, q_itemsize
) -> int:
    """An upper estimate of the shared memory the Triton kernel's program takes: the K and V
    tiles of every pipeline stage, the query block and the [rows, kv] probabilities (checked
    against the real compiler for H100 in tests/test_accelerator_compile.py)."""
    group_padded = 1 << (group - 1).bit_length()
    rows = max(sizes.q_block * group_padded, 16)
    kv = sizes.kv_pages * page_size
    tiles = sizes.num_stages * kv * 2 * head_dim * max(kv_itemsize, q_itemsize)
    return tiles + rows * head_dim * q_itemsize + rows * kv * 4


def _fit_gpu(sizes: BlockSizes, limit: int, **shape) -> BlockSizes:
    """Halves the KV block, then the pipeline depth, then the query block, until the program's
    shared memory fits `limit` (head_dim 256 with 16-token query blocks did not fit an H100)."""
    while gpu_shared_memory(sizes, **shape) > limit:
        if sizes.kv_pages > 1 and sizes.kv_pages * shape["page_size"] > 16:
            sizes = dataclasses.replace(sizes, kv_pages=sizes.kv_pages // 2)
        elif sizes.num_stages > 1:
            sizes = dataclasses.replace(sizes, num_stages=sizes.num_stages - 1)
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
) -> BlockSizes:
    """Block sizes for one call shape on the current device (or `device_kind`). `group` (query
    heads per kv head) and the itemsizes of the cache and the queries size the GPU program's
    shared memory, which the sizes are cut down to fit."""
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
    kv_pages = max(1, entry.kv_tokens // page_size)
    # A work item (a GPU program, a TPU grid step) serves one request's block of queries, so a
    # block longer than the batch's mean query length is mostly padding (a decode batch has
    # one token per request). Powers of two: Triton's block shapes must be.
    mean_q = -(-num_tokens // max(max_reqs, 1))
    q_block = min(entry.q_block, 1 << (mean_q - 1).bit_length())
    kv_pages = 1 << (kv_pages.bit_length() - 1)
    sizes = BlockSizes(q_block, kv_pages, entry.num_warps, entry.num_stages)
    if backend == "pallas_gpu" and family != "cpu":
        limit = _GPU_SHARED_MEMORY.get(family, _GPU_SHARED_MEMORY["*"])
        shape = dict(page_size=page_size, head_dim=head_dim, group=group)
        sizes = _fit_gpu(sizes, limit, kv_itemsize=kv_itemsize, q_itemsize=q_itemsize, **shape)
    return sizes
