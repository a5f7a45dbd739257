"""How XLA's matmul on this device scales with the rows of a decode batch: x[M, K] @ W[K, N]
in bfloat16 for Llama-3-8B's projections (q/o, gate/up fused, down, the vocabulary head), M
from 1 to 256. A decode step streams every weight once, so a good matmul takes about the same
time at M = 1 as at M = 64; GB/s counts W once (and x and the output).

    python benchmarks/kernels/matmul_rows.py [--rows 1,8,64,256] [--iters 50] [--json PATH]

Each call is timed by issuing `--iters` calls back to back and waiting once (best of three),
over 4 weight copies in turn so L2 does not serve them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from ragged_attention import pipelined_seconds  # noqa: E402

SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (4096, 128256)]  # (K, N)
COPIES = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'K':>6} {'N':>7} {'M':>4} {'us':>9} {'GB/s':>8}")
    rows = []
    matmul = jax.jit(lambda x, w: x @ w)
    for k, n in SHAPES:
        keys = jax.random.split(jax.random.key(0), COPIES)
        ws = [jax.random.normal(key, (k, n), jnp.bfloat16) for key in keys]
        for m in args.rows:
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            for w in ws:
                matmul(x, w).block_until_ready()
            best = pipelined_seconds(lambda i, x=x, ws=ws: matmul(x, ws[i % COPIES]), args.iters)
            nbytes = 2 * (k * n + m * k + m * n)
            row = {"K": k, "N": n, "M": m, "us": round(1e6 * best, 2)}
            row["gb_s"] = round(nbytes / best / 1e9, 1)
            print(f"{k:>6} {n:>7} {m:>4} {row['us']:>9.1f} {row['gb_s']:>8.1f}", flush=True)
            rows.append(row)
        del ws
    if args.json:
        args.json.write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}))


if __name__ == "__main__":
    main()
