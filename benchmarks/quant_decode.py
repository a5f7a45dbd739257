"""Decode time per step (TPOT) by weight format, in one run: a GGUF file kept quantized
against its float32 dequantization (the issue's bar: batch 1 kept quantized >= 2.5x float32).

    .venv/bin/python benchmarks/quant_decode.py [--model smollm2-135m] \
        [--quantizations float,gguf] [--batch-sizes 1,8] [--input-len 128] [--steps 64] \
        [--repeats 3] [--json PATH]

For each quantization an `LLM` is built (its warmup compiles every program), then per batch
size `generate` runs --batch-sizes prompts of --input-len random tokens for 1 and for
1 + --steps output tokens (greedy, ignore_eos, the prefix cache emptied each time); TPOT is
the difference of the medians over --steps. That is the engine's whole decode step as
`LLM.generate` drives it: the matmuls, attention, sampler and the host's scheduling.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.bench import cpu_name, write_json
from jaxllm.model_files import demo_model_path


def tpot_ms(llm: LLM, batch: int, input_len: int, steps: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 20000, input_len).tolist()} for _ in range(batch)
    ]

    def run(n: int) -> float:
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)  # untimed
    first = statistics.median(run(1) for _ in range(repeats))
    whole = statistics.median(run(1 + steps) for _ in range(repeats))
    return (whole - first) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a demo model name or a path")
    p.add_argument("--quantizations", default="float,gguf")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    try:
        model = str(demo_model_path(args.model))
    except (KeyError, ValueError):
        model = args.model
    batches = [int(b) for b in args.batch_sizes.split(",")]
    quantizations = args.quantizations.split(",")
    rows = []
    for quantization in quantizations:
        llm = LLM(
            model,
            quantization=quantization,
            max_num_seqs=max(batches),
            max_model_len=args.input_len + args.steps + 16,
            num_pages=max(64, max(batches) * (args.input_len + args.steps + 16) // 16 + 8),
        )
        for batch in batches:
            ms = tpot_ms(llm, batch, args.input_len, args.steps, args.repeats)
            rows.append({"quantization": quantization, "batch": batch, "tpot_ms": round(ms, 2)})
            print(
                f"{quantization:>8} batch {batch:>3}: TPOT {ms:7.2f} ms, {batch * 1e3 / ms:6.1f} tok/s"
            )
        del llm
    by = {(r["quantization"], r["batch"]): r["tpot_ms"] for r in rows}
    first = quantizations[0]
    for q in quantizations[1:]:
        for b in batches:
            print(f"{q} vs {first}, batch {b}: {by[first, b] / by[q, b]:.2f}x")
    if args.json:
        write_json(args.json, {"cpu": cpu_name(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
