"""KV-cache bytes per token of the demo models, as allocated, next to what a cache that frees
the blocks sliding-window layers no longer see would hold (vLLM's per-layer-group block
tables), at several context lengths.

    .venv/bin/python benchmarks/kv_bytes.py [--json benchmarks/results/kv-bytes.json]

The allocated figure is measured: the engine's KV cache array, in bytes, over its token slots.
The window-aware figure is computed from the config: full-attention layers keep every token,
sliding layers at most `window` tokens plus one partly used page.
"""

from __future__ import annotations

import argparse
import json

CONTEXTS = (512, 2048, 8192, 32768)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxllm import LLM

    rows = []
    for name in args.models.split(","):
        llm = LLM(name, dtype=args.dtype, num_pages=64, max_model_len=512, skip_warmup=True)
        c, cache = llm.model_config, llm.runner.kv_cache
        slots = cache.shape[1] * cache.shape[2]
        per_layer = cache.nbytes // slots // c.num_layers
        windows = [c.layer_window(i) for i in range(c.num_layers)]
        page = cache.shape[2]
        row = {
            "model": name,
            "dtype": args.dtype,
            "layers": c.num_layers,
            "sliding_layers": sum(w is not None for w in windows),
            "window": c.sliding_window,
            "allocated_bytes_per_token": cache.nbytes // slots,
            "window_aware_bytes_per_token": {},
        }
        for ctx in CONTEXTS:
            kept = sum(ctx if w is None else min(ctx, w + page) for w in windows)
            row["window_aware_bytes_per_token"][ctx] = round(per_layer * kept / ctx)
        rows.append(row)
        aware = ", ".join(f"{ctx}: {b:,}" for ctx, b in row["window_aware_bytes_per_token"].items())
        print(
            f"{name} ({args.dtype}): {row['layers']} layers, {row['sliding_layers']} sliding "
            f"(window {row['window']}); allocated {row['allocated_bytes_per_token']:,} B/token; "
            f"window-aware at context {aware} B/token"
        )
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
