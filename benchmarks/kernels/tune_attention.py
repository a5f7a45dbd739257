"""Block-size sweep of the Pallas attention kernel on the device at hand: the rows of
`pallas_kernels/tuning.py`'s table, measured.

    python benchmarks/kernels/tune_attention.py [--backend pallas_gpu] [--json PATH] [--quick]

For each shape (decode and prefill batches of 8B-, Gemma-3- and SmolLM2-like heads, built as
`ragged_attention.py` builds them: random pages, block tables a random permutation), every
candidate (query block, KV tokens per block, and for Triton warps and pipeline stages) is
compiled (in parallel threads: compiling dominates a sweep's time) and checked against the
reference, then timed: `--iters` calls issued back to back and waited for once, three times,
the best of the three per call (a decode call is tens of microseconds, so waiting on each
call would time the host). Candidates that do not compile (over the shared memory, say) are
listed with the reason. Printed per shape: the table's current choice, the fastest, and their
ratio; the JSON has every candidate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.tuning import BlockSizes, device_family, get_block_sizes

sys.path.insert(0, str(Path(__file__).parent))
from ragged_attention import make_inputs, pipelined_seconds  # noqa: E402

# (name, q heads, kv heads, head_dim, page size, batch, context, q_len)
SHAPES = [
    ("8b-decode-b64-c2k", 32, 8, 128, 16, 64, 2048, 1),
    ("8b-decode-b16-c8k", 32, 8, 128, 16, 16, 8192, 1),
    # Few programs against the SMs: where split-KV (`num_splits`) pays, if anywhere.
    ("8b-decode-b8-c8k", 32, 8, 128, 16, 8, 8192, 1),
    ("8b-decode-b1-c8k", 32, 8, 128, 16, 1, 8192, 1),
    ("8b-prefill-b4-q256-c2k", 32, 8, 128, 16, 4, 2048, 256),
    ("gemma3-decode-b32-c4k", 4, 1, 256, 16, 32, 4096, 1),
    ("smollm2-decode-b64-c2k", 9, 3, 64, 16, 64, 2048, 1),
]
QUICK_SHAPES = [
    ("tiny-decode", 4, 2, 128, 16, 2, 64, 1),
    ("tiny-prefill", 4, 2, 128, 16, 2, 64, 32),
]


def candidates(backend: str, head_dim: int, q_len: int, quick: bool) -> list[BlockSizes]:
    q_blocks = [1] if q_len == 1 else [16, 32, 64]
    kv_tokens = [16, 32, 64] if head_dim >= 256 else [32, 64, 128, 256]
    if backend == "pallas_tpu":
        kv_tokens, warps, stages = [128, 256, 512, 1024], [4], [2]
        q_blocks = [8, 16, 32, 64] if q_len > 1 else [8, 32]
    else:
        warps, stages = [4, 8], [2, 3, 4] if q_len == 1 else [2, 3]
    # Split-KV shares for a GPU decode (`ragged_attention_gpu`): 1 is no split.
    splits = [1, 2, 4, 8, 16] if q_len == 1 and backend == "pallas_gpu" else [1]
    if quick:
        q_blocks, kv_tokens, warps, stages = q_blocks[:1], kv_tokens[:2], warps[:1], stages[:1]
        splits = splits[:2]
    return [
        BlockSizes(q, max(1, kv // 16), w, s, n)
        for q, kv, w, s, n in itertools.product(q_blocks, kv_tokens, warps, stages, splits)
    ]


def sweep_shape(backend: str, shape: tuple, args) -> dict:
    name, n, k, h, page, batch, context, q_len = shape
    ns = SimpleNamespace(
        page_size=page,
        num_kv_heads=k,
        num_q_heads=n,
        head_dim=h,
        dtype=jnp.dtype(args.dtype),
        kv_cache_dtype=None,
        q_len=q_len,
    )
    inputs = make_inputs(ns, batch, context)
    ref = jax.jit(functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=h**-0.5))(
        *inputs
    ).astype(jnp.float32)
    current = get_block_sizes(
        backend,
        head_dim=h,
        page_size=page,
        num_tokens=batch * q_len,
        max_reqs=batch,
        group=n // k,
        kv_itemsize=ns.dtype.itemsize,
        q_itemsize=ns.dtype.itemsize,
        num_kv_heads=k,
    )
    cands = candidates(backend, h, q_len, args.quick)
    if current not in cands:
        cands.append(current)

    def compile_one(sizes: BlockSizes):
        fn = jax.jit(
            functools.partial(
                pallas_kernels.ragged_paged_attention,
                sm_scale=h**-0.5,
                backend=backend,
                block_sizes=sizes,
                interpret=args.interpret,
            )
        )
        start = time.perf_counter()
        try:
            return fn.lower(*inputs).compile(), time.perf_counter() - start, None
        except Exception as e:  # noqa: BLE001 - a candidate that cannot compile is a result
            return None, time.perf_counter() - start, f"{type(e).__name__}: {str(e)[:200]}"

    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        compiled = list(pool.map(compile_one, cands))
    rows = []
    for sizes, (fn, compile_s, error) in zip(cands, compiled, strict=True):
        row = {**sizes.__dict__, "compile_s": round(compile_s, 2)}
        if error is None:
            out = fn(*inputs).block_until_ready()
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
            for _ in range(2):
                fn(*inputs).block_until_ready()
            best = pipelined_seconds(lambda _, fn=fn: fn(*inputs), args.iters)
            row.update(us=round(1e6 * best, 2), max_abs_err=err)
        else:
            row["error"] = error
        rows.append(row)
    ok = [r for r in rows if "us" in r]
    fastest = min(ok, key=lambda r: r["us"]) if ok else None
    mine = rows[cands.index(current)]  # `current` is always a candidate
    return {
        "shape": dict(
            zip(
                (
                    "name",
                    "num_q_heads",
                    "num_kv_heads",
                    "head_dim",
                    "page_size",
                    "batch",
                    "context",
                    "q_len",
                ),
                shape,
                strict=True,
            )
        ),
        "current": current.__dict__,
        "current_us": mine.get("us"),
        "fastest": fastest,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None, help="default: the platform's Pallas kernel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=8, help="compiles at once")
    p.add_argument("--shapes", default=None, help="names from SHAPES, comma-separated")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few candidates")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    backend = args.backend or pallas_kernels.resolve_backend("pallas")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    device_kind = jax.devices()[0].device_kind
    print(
        f"device: {device_kind}, family {device_family(device_kind)}, backend {backend}, jax {jax.__version__}"
    )
    results = []
    for shape in shapes:
        start = time.perf_counter()
        r = sweep_shape(backend, shape, args)
        results.append(r)
        f, ok = r["fastest"], sum("us" in row for row in r["rows"])
        line = f"{shape[0]:<26} {ok}/{len(r['rows'])} compiled in {time.perf_counter() - start:.0f} s; "
        line += f"current {r['current']} {r['current_us']} us"
        if f is not None:
            ratio = "" if r["current_us"] is None else f" ({r['current_us'] / f['us']:.2f}x faster)"
            line += f"; fastest q_block={f['q_block']} kv_pages={f['kv_pages']} warps={f['num_warps']} stages={f['num_stages']} splits={f.get('num_splits', 1)} {f['us']} us{ratio} err {f['max_abs_err']:.1e}"
        print(line, flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device_kind": device_kind,
                    "backend": backend,
                    "jax": jax.__version__,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
