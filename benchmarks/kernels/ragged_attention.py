"""Microbenchmark of `pallas_kernels.ragged_paged_attention`: time, bytes read, bandwidth.

    .venv/bin/python benchmarks/kernels/ragged_attention.py [--backend reference,pallas_gpu] \
        [--batch 8,16,32,64,128,256] [--context 1024,2048,4096,8192] [--q-len 1] \
        [--num-q-heads 32] [--num-kv-heads 8] [--head-dim 128] [--page-size 16] \
        [--dtype bfloat16] [--kv-cache-dtype int8|fp8] [--iters 20] [--warmup 3] [--check] \
        [--json PATH]
    .venv/bin/python benchmarks/kernels/ragged_attention.py --quick [--interpret]  # CPU, seconds

For each (batch, context) it builds one layer of a random paged KV cache (fixed seed) with
`batch * ceil(context / page_size)` pages plus a few spare, and block tables that are a random
permutation of the pages, so reads are scattered as in serving. Every sequence holds `context`
tokens; its last `q_len` are this step's queries (q_len 1 is decode). Each backend's jitted
call is compiled (the time is reported), run `--warmup` times, then timed `--iters` times, one
call with `block_until_ready` each; the median and min are reported.

Bytes = K/V of every sequence (batch * context * 2K * H * itemsize, an 8-bit cache's scales
included) + q + output: what an ideal kernel moves through HBM once. `--kv-cache-dtype`
quantizes the random cache to int8 or fp8 (`pallas_kernels/kv_cache.py`); q stays `--dtype`. GB/s = bytes / median time, with its share of the
device's peak HBM bandwidth ("n/a" on a device not in `PEAK_HBM_GB_S`, such as CPU). "vs ref"
is the backend's median over the reference's on the same config. The time of an empty jitted
call is printed as the host dispatch floor: a config timed near it measures the host, not the
kernel. K/V smaller than a GPU's L2 cache may be served partly from L2 across iterations.

Backends default to "reference" plus the Pallas backend of the platform (pallas_gpu on GPU,
pallas_tpu on TPU) if `pallas_kernels.BACKENDS` has it; on CPU the native kernel ("cpu") and,
with --interpret, every Pallas backend it has (the interpreter checks correctness; its times say nothing about hardware).
--quick sets tiny sizes and iteration counts; flags given explicitly still win. A config that
does not fit device memory is skipped with a message, as is a Pallas backend that rejects a
shape (ValueError / NotImplementedError).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.kv_cache import quantize_kv_cache
from pallas_kernels.tuning import device_family

# Peak HBM bandwidth (GB/s) by device family, as `pallas_kernels.tuning.device_family` names
# them from `device_kind` (the same names key the kernels' block-size table).
PEAK_HBM_GB_S = {"v5e": 819, "v5p": 2765, "v6e": 1638, "h100": 3350, "h200": 4800}


# Sizes and iteration counts that a flag left unset takes, per preset.
DEFAULTS = {
    "batch": [8, 16, 32, 64, 128, 256],
    "context": [1024, 2048, 4096, 8192],
    "num_q_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "iters": 20,
    "warmup": 3,
}
QUICK = {
    "batch": [2, 4],
    "context": [64, 128],
    "num_q_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 128,
    "iters": 3,
    "warmup": 1,
}

SPARE_PAGES = 8  # pages no block table points at, so the cache is not exactly the batch's
SEED = 0


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def peak_hbm_gb_s(device_kind: str) -> float | None:
    return PEAK_HBM_GB_S.get(device_family(device_kind))


def default_backends(platform: str, interpret: bool) -> list[str]:
    pallas = [b for b in pallas_kernels.BACKENDS if b.startswith("pallas_")]
    if platform == "cpu":  # the native C++ kernel, and interpreted Pallas ones when asked
        return ["reference", "cpu"] + (pallas if interpret else [])
    native = pallas_kernels.resolve_backend("pallas", platform)
    return ["reference"] + ([native] if native in pallas else [])


def is_oom(error: Exception) -> bool:
    text = str(error)
    return (
        isinstance(error, MemoryError)
        or "RESOURCE_EXHAUSTED" in text
        or "out of memory" in text.lower()
    )


def free_bytes() -> int | None:
    """Device memory still free, where the backend reports it (GPU, TPU; not CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def make_inputs(args, batch: int, context: int) -> tuple:
    """The op's positional arguments for one config: q, kv_cache, layer, seq_lens, ..."""
    pages_per_seq = -(-context // args.page_size)
    num_pages = batch * pages_per_seq + SPARE_PAGES
    shape = pallas_kernels.get_kv_cache_shape(
        1, num_pages, args.page_size, args.num_kv_heads, args.head_dim
    )
    key_cache, key_q = jax.random.split(jax.random.key(SEED))
    kv_cache = jax.random.normal(key_cache, shape, args.dtype)  # [1, pages, K, page_size, 2H]
    if args.kv_cache_dtype is not None:
        dtype = pallas_kernels.QUANTIZED_KV_DTYPES[args.kv_cache_dtype]
        kv_cache = quantize_kv_cache(kv_cache, dtype)
    q = jax.random.normal(key_q, (batch * args.q_len, args.num_q_heads, args.head_dim), args.dtype)
    rng = np.random.default_rng(SEED)
    block_tables = rng.permutation(num_pages)[: batch * pages_per_seq]
    block_tables = block_tables.reshape(batch, pages_per_seq).astype(np.int32)  # [R, P]
    seq_lens = np.full(batch, context, np.int32)  # [R]
    cu_q_lens = np.arange(batch + 1, dtype=np.int32) * args.q_len  # [R + 1]
    num_seqs = np.array([batch], np.int32)  # [1]
    layer = jnp.int32(0)  # traced, as under the model's layer scan
    inputs = (q, kv_cache, layer, *map(jnp.asarray, (seq_lens, block_tables, cu_q_lens)))
    return (*inputs, jnp.asarray(num_seqs))


def make_fn(backend: str, args):
    # `interpret` exists only beside the Pallas backends; the reference has no such keyword.
    extra = {"interpret": args.interpret} if backend.startswith("pallas_") else {}
    return jax.jit(
        functools.partial(
            pallas_kernels.ragged_paged_attention,
            sm_scale=args.head_dim**-0.5,
            backend=backend,
            **extra,
        )
    )


def time_call(fn, inputs, warmup: int, iters: int) -> tuple[jax.Array, float, list[float]]:
    """Compiles, warms up and times `fn(*inputs)`: (output, compile seconds, call seconds)."""
    start = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    out = compiled(*inputs).block_until_ready()
    for _ in range(warmup - 1):
        out = compiled(*inputs).block_until_ready()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = compiled(*inputs).block_until_ready()
        times.append(time.perf_counter() - start)
    return out, compile_s, times


def pipelined_seconds(call, iters: int, repeats: int = 3) -> float:
    """Seconds per call of `call(i)` (which launches call i and returns its output) issued
    `iters` times back to back and waited for once, the best of `repeats`: for calls short
    enough that waiting on each would time the host, not the device."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(iters):
            out = call(i)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def dispatch_floor_us(iters: int = 50) -> float:
    """Median time of an empty jitted call with block_until_ready: the host's share of a call."""
    x = jnp.zeros((), jnp.int32)
    _, _, times = time_call(jax.jit(lambda x: x + 1), (x,), 1, iters)
    return 1e6 * statistics.median(times)


HEADER = (
    f"{'backend':<12} {'batch':>5} {'context':>7} {'median_us':>10} {'min_us':>10} "
    f"{'MB':>9} {'GB/s':>8} {'%peak':>6} {'vs_ref':>7} {'max_err':>9} {'compile_s':>9}"
)


def opt(value, fmt: str) -> str:
    """`value` formatted, or "n/a" for None."""
    return "n/a" if value is None else format(value, fmt)


def format_row(row: dict) -> str:
    share = row["peak_share"]
    return (
        f"{row['backend']:<12} {row['batch']:>5} {row['context']:>7} "
        f"{row['median_us']:>10.1f} {row['min_us']:>10.1f} {row['bytes'] / 1e6:>9.1f} "
        f"{row['gb_s']:>8.1f} {opt(share if share is None else 100 * share, '.1f'):>6} "
        f"{opt(row['vs_reference'], '.3f'):>7} {opt(row.get('max_abs_err'), '.2e'):>9} "
        f"{row['compile_s']:>9.2f}"
    )


def run_config(args, batch: int, context: int, peak: float | None) -> list[dict]:
    """All backends on one (batch, context); the reference runs first so others compare to it."""
    base = {"batch": batch, "context": context, "q_len": args.q_len}
    itemsize = jnp.dtype(args.dtype).itemsize
    head_bytes = pallas_kernels.kv_bytes_per_token_head(
        args.head_dim,
        pallas_kernels.QUANTIZED_KV_DTYPES.get(args.kv_cache_dtype, args.dtype),
    )
    num_tokens = batch * args.q_len
    kv_bytes = batch * context * 2 * args.num_kv_heads * head_bytes
    q_bytes = num_tokens * args.num_q_heads * args.head_dim * itemsize
    pages = batch * -(-context // args.page_size) + SPARE_PAGES
    cache_bytes = pages * args.page_size * 2 * args.num_kv_heads * head_bytes
    free = free_bytes()
    if free is not None and cache_bytes + 2 * q_bytes > free:
        reason = f"needs {(cache_bytes + 2 * q_bytes) / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        print(f"skip batch={batch} context={context}: {reason}")
        return [{**base, "skipped": reason}]
    try:
        inputs = make_inputs(args, batch, context)
    except Exception as e:
        if not is_oom(e):
            raise
        print(f"skip batch={batch} context={context}: out of memory building the inputs")
        return [{**base, "skipped": "out of memory building the inputs"}]

    rows, ref_out, ref_median = [], None, None
    for backend in args.backend:
        try:
            out, compile_s, times = time_call(
                make_fn(backend, args), inputs, args.warmup, args.iters
            )
        except Exception as e:
            unsupported = backend != "reference" and isinstance(e, ValueError | NotImplementedError)
            if not (is_oom(e) or unsupported):
                raise
            reason = "out of memory" if is_oom(e) else f"{type(e).__name__}: {e}"
            print(f"skip {backend} batch={batch} context={context}: {reason}")
            rows.append({**base, "backend": backend, "skipped": reason})
            continue
        median = statistics.median(times)
        row = {
            **base,
            "backend": backend,
            "num_tokens": num_tokens,
            "compile_s": round(compile_s, 3),
            "median_us": round(1e6 * median, 2),
            "min_us": round(1e6 * min(times), 2),
            "kv_bytes": kv_bytes,
            "bytes": kv_bytes + 2 * q_bytes,
            "gb_s": round((kv_bytes + 2 * q_bytes) / median / 1e9, 2),
            "peak_share": None,
            "vs_reference": None,
        }
        if peak is not None:
            row["peak_share"] = round(row["gb_s"] / peak, 4)
        if backend == "reference":
            ref_out, ref_median = out, median
        elif ref_median is not None:
            row["vs_reference"] = round(median / ref_median, 3)
        if args.check and backend != "reference":
            if ref_out is None:  # reference not benchmarked (or skipped): compute it untimed
                ref_out = make_fn("reference", args)(*inputs)
            err = jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32)))
            row["max_abs_err"] = float(err)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--backend",
        action="append",
        help=f"repeatable or comma list, of {pallas_kernels.BACKENDS}; default: reference plus "
        "the platform's Pallas backend",
    )
    p.add_argument("--interpret", action="store_true", help="run Pallas backends interpreted")
    p.add_argument("--batch", type=int_list, help=f"sequences (default {DEFAULTS['batch']})")
    p.add_argument("--context", type=int_list, help=f"tokens per sequence ({DEFAULTS['context']})")
    p.add_argument("--q-len", type=int, default=1, help="query tokens per sequence (1 = decode)")
    p.add_argument("--num-q-heads", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv-cache-dtype", choices=list(pallas_kernels.QUANTIZED_KV_DTYPES))
    p.add_argument("--iters", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--check", action="store_true", help="max abs error against the reference")
    p.add_argument("--json", metavar="PATH", help="also write device, args and rows as JSON")
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds on CPU")
    args = p.parse_args()

    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    platform = jax.default_backend()
    if args.backend:
        args.backend = [b for entry in args.backend for b in entry.split(",") if b]
    else:
        args.backend = default_backends(platform, args.interpret)
    unknown = [b for b in args.backend if b not in pallas_kernels.BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {unknown}; available: {pallas_kernels.BACKENDS}")
    # Reference first, so every other backend's row can show its ratio and error against it.
    args.backend = sorted(dict.fromkeys(args.backend), key=lambda b: b != "reference")
    if (
        platform == "cpu"
        and not args.interpret
        and any(b.startswith("pallas_") for b in args.backend)
    ):
        p.error("Pallas backends run on CPU only with --interpret")
    if args.q_len < 1 or args.q_len > min(args.context):
        p.error(f"--q-len must be in [1, {min(args.context)}] (the smallest context)")
    if args.iters < 1 or args.warmup < 1:
        p.error("--iters and --warmup must be >= 1 (the first call after compiling is warmup)")

    device_kind = jax.devices()[0].device_kind
    peak = peak_hbm_gb_s(device_kind)
    floor_us = dispatch_floor_us()
    print(
        f"device: {device_kind} ({platform}), jax {jax.__version__}, peak HBM "
        f"{'n/a' if peak is None else f'{peak} GB/s'}\n"
        f"q [batch * {args.q_len}, {args.num_q_heads}, {args.head_dim}], kv_cache "
        f"[1, pages, {args.num_kv_heads}, {args.page_size}, {2 * args.head_dim}] {args.dtype}, "
        f"block tables: "
        f"random page permutation; backends {args.backend}"
        f"{' (interpreted)' if args.interpret else ''}\n"
        f"dispatch floor (empty jitted call): {floor_us:.1f} us; {args.warmup} warmup, "
        f"{args.iters} timed calls per row\n\n{HEADER}",
        flush=True,
    )
    rows = []
    for batch in args.batch:
        for context in args.context:
            rows.extend(run_config(args, batch, context, peak))

    if args.json:
        result = {
            "device": f"{device_kind} ({platform})",
            "device_kind": device_kind,
            "jax_version": jax.__version__,
            "peak_hbm_gb_s": peak,
            "dispatch_floor_us": round(floor_us, 2),
            "args": vars(args),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
