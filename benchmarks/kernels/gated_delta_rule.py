"""The gated delta rule's forms on this machine, in one run: a prefill of one request, a ragged
mix (prefill chunks beside decode rows) and a decode batch, through the token-by-token
reference and the chunked form (the Pallas GPU kernel is timed only on a GPU: interpreted, it
measures the interpreter).

    .venv/bin/python benchmarks/kernels/gated_delta_rule.py [--heads 16] [--dim 128] [--json PATH]

Shapes: `heads` value heads of key and value dim `dim` (Qwen3.5's are 128; the 27B has 48
heads, 16 per device under 4-way tensor parallelism). Per case and form: the median wall time of
5 calls of the jitted function after one warm-up, and the largest difference of the outputs and
states from the reference's.
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

from pallas_kernels import gated_delta_rule


def _case(rng, lens: list[int], heads: int, dim: int):
    t = sum(lens)
    q, k = (rng.normal(size=(t, heads, dim)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    q *= dim**-0.5
    v = rng.normal(size=(t, heads, dim)).astype(np.float32)
    g = -rng.uniform(0, 0.1, size=(t, heads)).astype(np.float32)
    beta = rng.uniform(size=(t, heads)).astype(np.float32)
    initial = rng.normal(size=(len(lens), heads, dim, dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return [jnp.asarray(x) for x in (q, k, v, g, beta, initial, cu, [len(lens)])]


def _time(fn, args, repeats: int = 5) -> tuple[float, tuple]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    kernel = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(jax.default_backend(), [])
    forms = ["reference", "chunked", *kernel]
    cases = {
        "prefill 1 x 2048": [2048],
        "mixed 2 x 512 + 32 decodes": [512, 512] + [1] * 32,
        "decode 64": [1] * 64,
    }
    rng = np.random.default_rng(0)
    results = {"device": jax.devices()[0].device_kind, "heads": args.heads, "dim": args.dim}
    for name, lens in cases.items():
        inputs = _case(rng, lens, args.heads, args.dim)
        row, ref = {}, None
        for form in forms:
            fn = jax.jit(functools.partial(gated_delta_rule, backend=form))
            seconds, out = _time(fn, inputs)
            ref = ref or out
            diff = max(float(jnp.abs(a - b).max()) for a, b in zip(out, ref, strict=True))
            row[form] = {"ms": round(seconds * 1e3, 2), "max_diff": diff}
        for form in forms[1:]:
            row[form]["speedup"] = round(row["reference"]["ms"] / row[form]["ms"], 2)
        results[name] = row
        print(name, json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
