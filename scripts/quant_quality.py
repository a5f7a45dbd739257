"""Quality of each weight and KV-cache quantization against float32 on the same model:
perplexity of a held-out text (from `prompt_logprobs`), greedy agreement on a few prompts
(first diverging token), and the bytes of weights and of KV cache per token on the device.

    python scripts/quant_quality.py smollm2-135m --quantization float,int8,int4,fp8,gguf \
        --json benchmarks/results/quant_quality_cpu.json
    python scripts/quant_quality.py smollm2-135m --quantization float,float:int8,float:fp8 \
        --json benchmarks/results/kv_cache_quality_cpu.json

Each entry is a weight quantization, optionally with `:` and a `kv_cache_dtype`. The text is
scored in chunks of 512 tokens, so all but the first chunk's tokens attend to the cached
(and, with an 8-bit cache, quantized) K/V of the text before them, and each chunk to its own
K/V read back from the cache.

The text (tests/fixtures/heldout_python_docs.txt, 2,768 tokens for the demo model) is from
Python's own documentation (the "Exceptions", "Execution model" and "Naming" topics that ship
in `pydoc_data`); nothing is calibrated on it. The first quantization listed is the
reference of every ratio. `--text FILE` scores another text instead (the int4 head was
checked on five: the held-out one, the start of /usr/share/common-licenses/GPL-3, a piece of
argparse.py, and bash's INTRO and POSIX documents).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "heldout_python_docs.txt"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three uses of a paperclip:",
]


def measure(model: str, entry: str, max_tokens: int = 32, text: Path = TEXT) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.sharding import per_device_bytes

    quantization, _, kv_cache_dtype = entry.partition(":")
    start = time.perf_counter()
    llm = LLM(
        model,
        quantization=quantization or None,
        kv_cache_dtype=kv_cache_dtype or "auto",
        max_model_len=4096,
        max_num_seqs=4,
        max_num_batched_tokens=512,
    )
    load_s = time.perf_counter() - start
    ids = llm.tokenizer(text.read_text())["input_ids"]
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
        use_tqdm=False,
    )[0]
    logprobs = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    greedy = llm.generate(
        PROMPTS,
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    _, weight_bytes = per_device_bytes(llm.runner.state)
    cache = llm.runner.kv_cache
    return {
        "quantization": quantization or "none",
        "kv_cache_dtype": str(cache.dtype),
        # [L, pages, K, page_size, 2 * head_dim]: bytes over the tokens the pages hold
        "kv_cache_bytes_per_token": cache.nbytes // (cache.shape[1] * cache.shape[3]),
        "text_tokens": len(ids),
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "weight_bytes": weight_bytes,
        "greedy_tokens": [list(o.outputs[0].token_ids) for o in greedy],
        "load_and_warmup_s": round(load_s, 1),
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare(rows: list[dict]) -> list[dict]:
    ref = rows[0]
    for r in rows:
        r["perplexity_ratio"] = r["perplexity"] / ref["perplexity"]
        r["weight_bytes_ratio"] = r["weight_bytes"] / ref["weight_bytes"]
        r["kv_cache_bytes_ratio"] = r["kv_cache_bytes_per_token"] / ref["kv_cache_bytes_per_token"]
        r["first_divergence"] = [
            first_divergence(a, b)
            for a, b in zip(r["greedy_tokens"], ref["greedy_tokens"], strict=True)
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", default="float,int8,int4,fp8,gguf")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--text", type=Path, default=TEXT, help="the text scored (default: the held-out one)"
    )
    args = parser.parse_args()
    rows = compare([measure(args.model, q, text=args.text) for q in args.quantization.split(",")])
    print(
        f"{'quantization':>12} {'kv cache':>13} {'ppl':>8} {'ratio':>6} {'bytes':>11} "
        f"{'ratio':>6} {'kv B/tok':>8} {'ratio':>6}  divergence"
    )
    for r in rows:
        print(
            f"{r['quantization']:>12} {r['kv_cache_dtype']:>13} {r['perplexity']:8.3f} "
            f"{r['perplexity_ratio']:6.3f} {r['weight_bytes']:>11} {r['weight_bytes_ratio']:6.3f} "
            f"{r['kv_cache_bytes_per_token']:>8} {r['kv_cache_bytes_ratio']:6.3f}  "
            f"{r['first_divergence']}"
        )
    if args.json:
        import jax

        for r in rows:
            del r["greedy_tokens"]
        Path(args.json).write_text(
            json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
