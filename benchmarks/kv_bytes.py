"""KV-cache bytes per token of the demo models with the hybrid KV cache (`jaxllm.worker.kv_groups`:
sliding-window layers free the blocks behind their window) and without it
(`--disable-hybrid-kv-cache-manager`: every layer keeps every token), and how many sequences
of 8k tokens the same memory holds.

    .venv/bin/python benchmarks/kv_bytes.py [--json benchmarks/results/kv-bytes.json]

Measured, not computed from the config: each engine's page bytes are its KV cache array's
bytes over its pages, and a sequence's pages are what the engine's own KV cache manager holds
for it, driven as the scheduler drives it (prefill in steps of `max_num_batched_tokens`, then
decode, each step's blocks keyed a step late as under async scheduling). "Bytes per token at
context C" is the pages one sequence holds while it decodes at length C, over C. "Sequences
that fit" admits sequences of 8,192 tokens into a pool of `--budget-gib` until one no longer
fits.
"""

from __future__ import annotations

import argparse
import json

CONTEXTS = (512, 2048, 8192, 32768)


def _sequence(kv, rid: str, length: int, chunk: int) -> bool:
    """Drives one sequence of `length` tokens through `kv` as the scheduler would (its prompt
    all but the last token, then one decode step); False when the pool runs out."""
    from jaxllm import SamplingParams
    from jaxllm.engine.request import Request

    params = SamplingParams(max_tokens=1)
    req = Request(rid, list(range(length - 1)), params, eos_token_ids=(), max_tokens=1, seed=0)
    while req.num_computed_tokens < req.num_tokens:
        step = min(chunk, req.num_tokens - req.num_computed_tokens)
        if not kv.allocate_slots(req, step):
            return False
        req.num_computed_tokens += step
        req.num_inflight_tokens = step  # keyed when the next step is scheduled
        kv.cache_full_blocks(req)
    req.append_output_token(7)
    return kv.allocate_slots(req, 1)


def measure(name: str, dtype: str, hybrid: bool, budget_gib: float, chunk: int) -> dict:
    from jaxllm import LLM
    from jaxllm.engine.kv_cache_manager import KVCacheManager

    llm = LLM(
        name,
        dtype=dtype,
        num_pages=256,
        max_model_len=512,
        max_num_batched_tokens=chunk,
        skip_warmup=True,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    config, groups = llm.model_config, llm.runner.kv_groups
    page_size = llm.kv_cache_manager.page_size
    page_bytes = llm.runner.kv_cache.nbytes // llm.kv_cache_manager.num_pages
    del llm
    row = {
        "model": name,
        "dtype": dtype,
        "hybrid": hybrid,
        "layers": config.num_layers,
        "sliding_layers": sum(config.layer_window(i) is not None for i in range(config.num_layers)),
        "window": config.sliding_window,
        "groups": groups.num_groups,
        "slots_per_page": groups.num_slots,
        "page_bytes": page_bytes,
        "bytes_per_token": {},
    }
    for ctx in CONTEXTS:
        kv = KVCacheManager(1 << 20, page_size, windows=groups.windows)
        assert _sequence(kv, "a", ctx, chunk)
        row["bytes_per_token"][ctx] = round(kv.num_live_blocks("a") * page_bytes / ctx)
    num_pages = int(budget_gib * 2**30 // page_bytes)
    kv = KVCacheManager(num_pages, page_size, windows=groups.windows)
    n = 0
    while _sequence(kv, f"r{n}", 8192, chunk):
        n += 1
    row["pool_pages"], row["sequences_8k_fit"] = num_pages, n
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget-gib", type=float, default=1.0, help="the pool (CPU default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = []
    for name in args.models.split(","):
        pair = [
            measure(name, args.dtype, hybrid, args.budget_gib, args.max_num_batched_tokens)
            for hybrid in (False, True)
        ]
        for row in pair:
            per_token = ", ".join(f"{c}: {b:,}" for c, b in row["bytes_per_token"].items())
            print(
                f"{name} ({args.dtype}, {'hybrid' if row['hybrid'] else 'one group'}): "
                f"{row['layers']} layers, {row['sliding_layers']} sliding (window "
                f"{row['window']}), {row['groups']} group(s) of {row['slots_per_page']}; "
                f"bytes per token at context {per_token}; "
                f"{row['sequences_8k_fit']} sequences of 8k in {args.budget_gib} GiB"
            )
        off, on = pair
        print(
            f"{name}: hybrid / one group: bytes per token at 32k "
            f"{on['bytes_per_token'][32768] / off['bytes_per_token'][32768]:.3f}x, "
            f"8k sequences that fit {on['sequences_8k_fit'] / max(off['sequences_8k_fit'], 1):.2f}x"
        )
        rows += pair
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
