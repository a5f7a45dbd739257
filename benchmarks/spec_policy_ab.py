"""Plain decode against an engine with a speculative head run by its default policy
(`jaxllm.engine.spec_policy`), both in one process, batches of all the prompts in interleaved
rounds (so the machine's drift falls on both alike). Decode tok/s per round, printed as JSON.

    .venv/bin/python benchmarks/spec_policy_ab.py --head DIR --prompts held.jsonl \
        [--model smollm2-135m] [--quantization float] [--rounds 3] [--max-tokens 128]

Before the rounds each engine decodes one prompt alone, so the policy has measured batch 1.
"""

from __future__ import annotations

import argparse
import json

from eagle3_decode import ENGINE, add_args, run

from jaxllm import LLM
from jaxllm.training.eagle3 import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    convs = read_prompts(args.prompts)
    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k}
    engines = {
        "plain": LLM(args.model, quantization=args.quantization, **ENGINE),
        "adaptive": LLM(
            args.model, quantization=args.quantization, speculative_config=spec, **ENGINE
        ),
    }
    for llm in engines.values():
        run(llm, convs[:2], 8)  # first calls' one-time costs
        run(llm, convs[:1], 64)
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            tokens, seconds, ttft = run(llm, convs, args.max_tokens)
            n = sum(len(t) for t in tokens)
            rounds[name].append(round((n - len(convs)) / (seconds - ttft), 1))
    mean = {name: sum(v) / len(v) for name, v in rounds.items()}
    report = {
        "model": args.model,
        "head": args.head,
        "batch": len(convs),
        "decode_tok_s": rounds,
        "adaptive_over_plain": mean["adaptive"] / mean["plain"],
        "policy_rates": engines["adaptive"].engine.scheduler.speculation.rates(),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
