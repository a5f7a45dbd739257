"""The CPU quantized matmul (`pallas_kernels/cpu/quant_matmul.cc`) against its source at another
git revision, both built here and called in one process, alternately: a kernel change measured
against the code before it on the same machine at the same moment.

    .venv/bin/python benchmarks/kernels/quant_matmul_versions.py --baseline 350031b \
        [--format int4] [--tokens 1,2,8,32,256] [--layers 30] [--json PATH]

Two measurements, each the median (and min) of alternated calls:
- per matrix, in cache: the demo model's (SmolLM2-135M) shapes, q/k/v together (960x576),
  gate/up together (3072x576), down (576x1536) and the tied head (49152x576);
- a model-like sweep out of cache: `--layers` layers of those three matrices (1.9 MB each in
  int4) chained in one jitted function, as a decode step reads them: once each, from memory.

Weights are random codes with float16 factors per 32 inputs (int4 with offsets: GGUF's Q4_1;
int8 without: Q8_0). The baseline's library is built as the current one is and
registered under its own FFI target (`native._build`, given the revision's source and headers).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench import cpu_name, write_json
from pallas_kernels import native, quant_matmul_cpu

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
GROUP = 32


def build_baseline(rev: str, out_dir: Path) -> str:
    """The kernel's source at `rev`, built and registered; returns its FFI target name."""
    src = out_dir / "src"
    src.mkdir()
    tree = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "pallas_kernels/cpu/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in tree:
        if path.endswith((".cc", ".h")):
            blob = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, check=True
            ).stdout
            (src / Path(path).name).write_bytes(blob)
    lib = native._build("quant_matmul", sources=src)  # the same flags, cached by content
    handle = ctypes.cdll.LoadLibrary(str(lib))
    target = "jaxllm_quant_matmul_baseline"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handle.JaxllmQuantMatmul), platform="cpu")
    return target


def random_weight(rng, fmt: str, num_out: int, num_in: int):
    if fmt == "int4":
        q = rng.integers(0, 256, (num_out, num_in // 2), dtype=np.uint8)
    else:
        q = rng.integers(-127, 128, (num_out, num_in), dtype=np.int8)
    scale = (rng.random((num_out, num_in // GROUP)) * 0.01).astype(np.float16)
    offset = (-rng.random((num_out, num_in // GROUP)) * 0.08).astype(np.float16)
    return tuple(jnp.asarray(a) for a in (q, scale, offset if fmt == "int4" else offset[:1, :1]))


def matmul(target: str, fmt: str, x, w):
    q, scale, offset = w
    result = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(target, [result])(
        x, q, scale, offset, format=quant_matmul_cpu.FORMATS[fmt], has_offset=fmt == "int4"
    )[0]


def alternate(fns: dict, args, iters: int) -> dict:
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a git revision of this repository")
    p.add_argument("--format", default="int4", choices=["int4", "int8"])
    p.add_argument("--tokens", default="1,2,8,32,256")
    p.add_argument("--layers", type=int, default=30, help="of the out-of-cache sweep")
    p.add_argument("--json")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if quant_matmul_cpu._load() is not None:
        raise SystemExit("the native kernel cannot be built here")
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = build_baseline(args.baseline, Path(tmp))
        targets = {"baseline": base, "current": quant_matmul_cpu._target("native")}
        print(f"{cpu_name()}; integer path: {quant_matmul_cpu.path()}; {args.format}, groups of 32")
        print(f"{'what':<22} {'T':>4} {'baseline ms':>12} {'current ms':>11} {'speedup':>8}")

        def record(what: str, t: int, result: dict) -> None:
            (b, b_min), (c, c_min) = result["baseline"], result["current"]
            rows.append(
                {
                    "what": what,
                    "tokens": t,
                    "baseline_median_ms": round(b * 1e3, 4),
                    "current_median_ms": round(c * 1e3, 4),
                    "baseline_min_ms": round(b_min * 1e3, 4),
                    "current_min_ms": round(c_min * 1e3, 4),
                    "speedup": round(b / c, 3),
                }
            )
            print(f"{what:<22} {t:>4} {b * 1e3:>12.3f} {c * 1e3:>11.3f} {b / c:>8.2f}", flush=True)

        for num_out, num_in in SHAPES:
            w = random_weight(rng, args.format, num_out, num_in)
            fns = {
                name: jax.jit(lambda x, w, t=target: matmul(t, args.format, x, w))
                for name, target in targets.items()
            }
            for t in tokens:
                x = jnp.asarray(rng.standard_normal((t, num_in)), jnp.float32)
                iters = max(15, min(300, int(3e9 / (t * num_out * num_in + 1e7))))
                record(f"{num_out}x{num_in} (cache)", t, alternate(fns, (x, w), iters))

        weights = [
            random_weight(rng, args.format, o, i) for _ in range(args.layers) for o, i in SHAPES[:3]
        ]

        def sweep(target):
            def step(x, weights):
                h = x
                for i in range(0, len(weights), 3):
                    a = matmul(target, args.format, h, weights[i])[:, :576]
                    b = matmul(target, args.format, a, weights[i + 1])[:, :1536]
                    h = h + 1e-3 * matmul(target, args.format, b, weights[i + 2])
                return h

            return jax.jit(step)

        fns = {name: sweep(target) for name, target in targets.items()}
        for t in tokens:
            x = jnp.asarray(rng.standard_normal((t, 576)), jnp.float32)
            record(f"{args.layers} layers (memory)", t, alternate(fns, (x, weights), 20))
    result = {
        "cpu": cpu_name(),
        "integer_path": quant_matmul_cpu.path(),
        "format": args.format,
        "baseline": args.baseline,
        "command": "benchmarks/kernels/quant_matmul_versions.py "
        f"--baseline {args.baseline} --format {args.format} --tokens {args.tokens} "
        f"--layers {args.layers}",
        "rows": rows,
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
