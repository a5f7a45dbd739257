"""The output head and the sampler of one decode step on this machine's JAX backend: what a
greedy batch (and a plainly sampled one) pays beyond the head's matmul, per row count and
vocabulary, and the [R, V]-sized arrays the compiled program makes outside the sampler's
optional branches.

    GLIBC_TUNABLES=... .venv/bin/python benchmarks/sampler_step.py [--rows 1 64 256] \
        [--vocab 49152 151936] [--hidden 64]
    PYTHONPATH=../old-checkout .venv/bin/python benchmarks/sampler_step.py   # the code before

Each program is a [R, hidden] x [hidden, V] head (float32, as the engine's logits are) followed
by: nothing (`head`: its first column, so the logits are still made), `jax.numpy.argmax`,
the sampler's `argmax`, `sample` with every row greedy, and `sample` with every row at
temperature 1 (no top-k/p). Times are medians of back-to-back calls, in ms. `rv_arrays`: the
instructions of the compiled greedy program's entry computation (outside `lax.cond` branches)
whose result is [R, V], the logits included; one is the logits alone. Run it with the glibc
settings `jaxllm.host_memory.TUNABLES` (as the engine's process has them), or every large
temporary is a fresh mapping and its page faults are timed too. The `PYTHONPATH` form measures
another checkout's sampler with this script (the sampler's inputs are built from its
`NEUTRAL` table).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.worker import sampler
from jaxllm.worker.sampling_inputs import _FIXED_WIDTHS, NEUTRAL, VOCAB


def inputs(rows: int, vocab: int, temperature: float) -> sampler.SamplingInputs:
    widths = {**_FIXED_WIDTHS, "history": 128, "bitmask": -(-vocab // 32)}
    out = {}
    for name, (dtype, value, width) in NEUTRAL.items():
        shape = (rows,) if width is None else (rows, widths[width])
        out[name] = np.full(shape, vocab if value == VOCAB else value, dtype)
    out["temperature"][:] = temperature
    return sampler.SamplingInputs(**out)


def median_ms(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def rv_arrays(fn, *args, rows: int, vocab: int) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    made = 0
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\S* ([\w-]+)\(", line)
        if m and m.group(1).endswith(f"[{rows},{vocab}]"):
            made += m.group(2) not in ("parameter", "get-tuple-element", "bitcast", "conditional")
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    results = []
    print(f"{'vocab':>7} {'rows':>5} {'head':>8} {'jnp.argmax':>10} {'argmax':>8} "
          f"{'greedy':>8} {'temp 1':>8} {'rv_arrays':>9}", flush=True)  # fmt: skip
    for vocab in args.vocab:
        w = jnp.asarray(rng.standard_normal((args.hidden, vocab), np.float32) * 0.1)
        for rows in args.rows:
            h = jnp.asarray(rng.standard_normal((rows, args.hidden), np.float32))
            greedy, plain = inputs(rows, vocab, 0.0), inputs(rows, vocab, 1.0)
            programs = {
                "head": (lambda h, w: (h @ w)[:, 0], ()),
                "jnp_argmax": (lambda h, w: jnp.argmax(h @ w, axis=-1), ()),
                "argmax": (lambda h, w: sampler.argmax(h @ w), ()),
                "greedy": (lambda h, w, s: sampler.sample(h @ w, s).sampled, (greedy,)),
                "temperature_1": (lambda h, w, s: sampler.sample(h @ w, s).sampled, (plain,)),
            }
            row = {"vocab": vocab, "rows": rows}
            for name, (fn, extra) in programs.items():
                row[name] = median_ms(jax.jit(fn), h, w, *extra, iters=args.iters)
            greedy_fn = programs["greedy"][0]
            row["rv_arrays"] = rv_arrays(greedy_fn, h, w, greedy, rows=rows, vocab=vocab)
            results.append(row)
            print(f"{vocab:>7} {rows:>5} {row['head']:>8.2f} {row['jnp_argmax']:>10.2f} "
                  f"{row['argmax']:>8.2f} {row['greedy']:>8.2f} {row['temperature_1']:>8.2f} "
                  f"{row['rv_arrays']:>9}", flush=True)  # fmt: skip
    if args.json:
        meta = {"backend": jax.default_backend(), "jax": jax.__version__, "hidden": args.hidden}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": results}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
