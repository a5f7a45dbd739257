"""A hybrid model's cache bytes per request against a pure-attention model of the same size.

A hybrid (Qwen3.5, Qwen3-Next) keeps keys and values only for its full-attention layers and a
fixed-size state per request for its linear ones. This prints, for a config (default:
Qwen3.5-27B's, `benchmarks/configs/qwen3.5-27b`) and a few context lengths, what one request
holds: its KV pages plus its state, against the same model with every layer full attention
(the same attention layer: heads, head size, cache dtype). The sizes come from the engine's
own sizing (`kv_sizing.bytes_per_page`, `linear_attention.state_bytes_per_slot`): logical
bytes, before any device's padding, one device (divide both by the tensor-parallel size).

    .venv/bin/python benchmarks/hybrid_memory.py [--config DIR] [--kv-cache-dtype bfloat16]
        [--json benchmarks/results/hybrid-memory.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm.families import FULL_ATTENTION  # noqa: E402
from jaxllm.loaders.hf import load_hf_config  # noqa: E402
from jaxllm.models.linear_attention import state_bytes_per_slot  # noqa: E402
from jaxllm.worker.kv_sizing import bytes_per_page  # noqa: E402

CONTEXTS = (1024, 4096, 32768, 131072, 262144)


def per_request(config, kv_dtype, state_dtype, context: int) -> dict[str, int]:
    """One request's cache bytes at `context` tokens: KV pages (whole 16-token pages) and
    state."""
    page = bytes_per_page(config, 16, kv_dtype)
    kv = -(-context // 16) * page
    state = state_bytes_per_slot(config, state_dtype) if config.linear_layers else 0
    return {"kv_bytes": kv, "state_bytes": state, "total_bytes": kv + state}


def main() -> None:
    root = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(root / "configs" / "qwen3.5-27b"))
    p.add_argument("--kv-cache-dtype", default="bfloat16")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    hybrid = load_hf_config(Path(args.config))
    if not hybrid.linear_layers:
        raise SystemExit(f"--config {args.config}: not a hybrid model (no linear layers)")
    attention = dataclasses.replace(
        hybrid, layer_types=(FULL_ATTENTION,) * hybrid.num_layers, linear_attention=None
    )
    kv_dtype, state_dtype = jnp.dtype(args.kv_cache_dtype), jnp.bfloat16  # conv state: bf16
    rows = []
    mib = 2**20
    print(
        f"{Path(args.config).name}: {len(hybrid.attention_layers)} attention + "
        f"{len(hybrid.linear_layers)} linear layers, against {hybrid.num_layers} attention "
        f"layers; KV in {kv_dtype.name}, MiB per request"
    )
    print(
        f"{'context':>8} {'hybrid KV':>10} {'+ state':>8} {'= hybrid':>9} {'attention':>10} ratio"
    )
    for context in CONTEXTS:
        h = per_request(hybrid, kv_dtype, state_dtype, context)
        a = per_request(attention, kv_dtype, state_dtype, context)
        ratio = h["total_bytes"] / a["total_bytes"]
        rows.append({"context": context, "hybrid": h, "attention": a, "ratio": ratio})
        print(
            f"{context:>8} {h['kv_bytes'] / mib:>10.1f} {h['state_bytes'] / mib:>8.1f} "
            f"{h['total_bytes'] / mib:>9.1f} {a['total_bytes'] / mib:>10.1f} {ratio:.2f}x"
        )
    page_h, page_a = (bytes_per_page(c, 16, kv_dtype) // 16 for c in (hybrid, attention))
    state = state_bytes_per_slot(hybrid, state_dtype)
    even = state / (page_a - page_h)
    print(
        f"KV per token: {page_h / 1024:.0f} KiB (hybrid) vs {page_a / 1024:.0f} KiB; the state "
        f"({state / mib:.1f} MiB) costs as much as {even:,.0f} tokens of the difference"
    )
    if args.json:
        result = {
            "config": Path(args.config).name,
            "kv_cache_dtype": kv_dtype.name,
            "kv_bytes_per_token": {"hybrid": page_h, "attention": page_a},
            "state_bytes_per_request": state,
            "break_even_tokens": even,
            "note": "logical bytes from the engine's sizing, one device; not a measurement",
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
