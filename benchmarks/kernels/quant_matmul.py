"""Microbenchmark of the quantized matmul (`jaxllm.quantization.qmatmul`) by backend: time,
bytes read, bandwidth, and each backend against XLA's dequantization on the same shape.

    .venv/bin/python benchmarks/kernels/quant_matmul.py [--backend xla,pallas] \
        [--format int8,int4] [--tokens 1,16,64,256] [--shapes 4096x4096,14336x4096,4096x14336] \
        [--group 128] [--dtype bfloat16] [--iters 20] [--warmup 3] [--json PATH]
    .venv/bin/python benchmarks/kernels/quant_matmul.py --quick   # CPU, seconds

A shape is `OxI` (output channels x inputs): the defaults are Llama-3-8B's q/o projection,
gate/up and down. Weights are random codes with random scales (and, for int4, offsets) per
`--group` inputs (int8 and fp8: one scale per channel), as `jaxllm.quantization` stores them;
x is random in `--dtype`. Each backend's call is jitted, compiled, run `--warmup` times and
timed `--iters` times with `block_until_ready`; median and min are reported.

Backends (`config.QUANT_MATMUL_BACKENDS` plus "native"): "xla" dequantizes with XLA ops (the
TPU's path), "pallas" is the Pallas kernel (`pallas_kernels/quant_matmul_gpu.py`, the GPU's;
interpreted off a GPU, so its CPU times say nothing), "native" the CPU's C++ kernel, and
"native:VARIANT" one build of it (`quant_matmul_cpu.VARIANTS`: "native:float" is its float
path, for the integer path's gain in one run). Default:
xla plus the platform's own (pallas on GPU, native on CPU).

Bytes = codes + scales + offsets + x + output: what a kernel must move through memory once.
GB/s = bytes / median, with its share of the device's peak bandwidth where known
(`ragged_attention.PEAK_HBM_GB_S`); "vs xla" = the backend's median over xla's; max_err is
the largest difference from xla's output over the largest |output|.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from ragged_attention import dispatch_floor_us, int_list, opt, peak_hbm_gb_s, time_call

from jaxllm.bench import write_json
from jaxllm.config import CompilationConfig, using_kernels
from jaxllm.quantization import qmatmul
from jaxllm.testing import random_qarray
from pallas_kernels import quant_matmul_cpu

DEFAULTS = {
    "tokens": [1, 16, 64, 256],
    "shapes": [(4096, 4096), (14336, 4096), (4096, 14336)],
    "iters": 20,
    "warmup": 3,
}
QUICK = {"tokens": [1, 8], "shapes": [(256, 512)], "iters": 3, "warmup": 1}


def _matmul(backend: str, x, w):
    if backend.startswith("native:"):  # one build of the CPU kernel, by its variant's name
        variant = backend.split(":", 1)[1]
        return quant_matmul_cpu.quant_matmul_cpu(x, w.q, w.scale, w.offset, w.fmt, variant)
    if backend == "native":  # the CPU's kernel is what "auto" picks there
        backend = "auto"
    # Inside the traced function: read while tracing, as the decoder sets it.
    with using_kernels(CompilationConfig(quant_matmul_backend=backend)):
        return qmatmul(x, w)


def run_config(args, fmt: str, shape: tuple[int, int], tokens: int, peak) -> list[dict]:
    num_out, num_in = shape
    rng = np.random.default_rng(0)
    groups = num_in // args.group if fmt == "int4" else 1
    w = random_qarray(rng, fmt, num_out, num_in, groups, fmt == "int4", np.float16)
    w = jax.tree.map(jnp.asarray, w)
    x = jnp.asarray(rng.standard_normal((tokens, num_in), np.float32), args.dtype)
    weight_bytes = w.nbytes
    total = weight_bytes + x.nbytes + tokens * num_out * 4
    base = {"format": fmt, "num_out": num_out, "num_in": num_in, "tokens": tokens}
    rows, xla_out, xla_median = [], None, None
    for backend in args.backend:
        fn = jax.jit(functools.partial(_matmul, backend))
        out, compile_s, times = time_call(fn, (x, w), args.warmup, args.iters)
        median = statistics.median(times)
        row = {
            **base,
            "backend": backend,
            "compile_s": round(compile_s, 3),
            "median_us": round(1e6 * median, 2),
            "min_us": round(1e6 * min(times), 2),
            "weight_bytes": weight_bytes,
            "bytes": total,
            "gb_s": round(total / median / 1e9, 2),
            "peak_share": None if peak is None else round(total / median / 1e9 / peak, 4),
            "vs_xla": None,
            "max_rel_err": None,
        }
        if backend == "xla":
            xla_out, xla_median = out, median
        elif xla_median is not None:
            row["vs_xla"] = round(median / xla_median, 3)
            scale = float(jnp.abs(xla_out).max())
            row["max_rel_err"] = float(jnp.abs(out - xla_out).max()) / max(scale, 1e-30)
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


HEADER = (
    f"{'backend':<8} {'fmt':<5} {'OxI':>11} {'T':>4} {'median_us':>10} {'min_us':>9} "
    f"{'MB':>7} {'GB/s':>7} {'%peak':>6} {'vs_xla':>7} {'max_err':>8} {'compile_s':>9}"
)


def format_row(row: dict) -> str:
    share = None if row["peak_share"] is None else 100 * row["peak_share"]
    return (
        f"{row['backend']:<8} {row['format']:<5} {row['num_out']:>5}x{row['num_in']:<5} "
        f"{row['tokens']:>4} {row['median_us']:>10.1f} {row['min_us']:>9.1f} "
        f"{row['bytes'] / 1e6:>7.1f} {row['gb_s']:>7.1f} {opt(share, '.1f'):>6} "
        f"{opt(row['vs_xla'], '.3f'):>7} {opt(row['max_rel_err'], '.1e'):>8} "
        f"{row['compile_s']:>9.2f}"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", type=lambda s: s.split(","), default=None)
    p.add_argument("--format", type=lambda s: s.split(","), default=["int8", "int4"])
    p.add_argument("--tokens", type=int_list, default=None)
    p.add_argument(
        "--shapes",
        type=lambda s: [tuple(map(int, part.split("x"))) for part in s.split(",")],
        default=None,
    )
    p.add_argument("--group", type=int, default=128, help="int4 inputs per scale")
    p.add_argument("--dtype", type=jnp.dtype, default=jnp.dtype("bfloat16"))
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend is None:
        platform = jax.default_backend()
        args.backend = ["xla", "native" if platform == "cpu" else "pallas"]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    peak = peak_hbm_gb_s(device.device_kind)
    print(f"device: {device.device_kind} ({jax.default_backend()}), dtype {args.dtype.name}")
    print(f"host dispatch floor: {dispatch_floor_us():.1f} us per call")
    print(HEADER)
    rows = [
        row
        for fmt in args.format
        for shape in args.shapes
        for tokens in args.tokens
        for row in run_config(args, fmt, shape, tokens, peak)
    ]
    result = {"device": device.device_kind, "dtype": args.dtype.name, "rows": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
