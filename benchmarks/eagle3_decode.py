"""An EAGLE-3 head against plain decode, in one process: batch 1 (each held-out prompt alone)
and a batch of all of them, greedy, the same tokens checked; the head speculating in every step
(`"adaptive": false`) and as the engine runs it by default (only where measured to pay,
`jaxllm.engine.spec_policy`). Printed as JSON (and written to --json).

    .venv/bin/python benchmarks/eagle3_decode.py --head DIR --prompts held.jsonl \
        [--model smollm2-135m] [--k 3] [--max-tokens 128] [--batch-1-prompts 8] [--json FILE]

Decode speed is output tokens over the time after the first token (each request's time to its
first token, measured alone, is left out: speculation does not touch the prefill). The head
comes from `jaxllm train-draft` (or any EAGLE-3 head for the model).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax

from jaxllm import LLM, SamplingParams
from jaxllm.bench import write_json
from jaxllm.training.eagle3 import read_prompts

ENGINE = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=1024)


def run(llm: LLM, convs: list, max_tokens: int) -> tuple[list, float, float]:
    """(tokens, seconds of the whole chat call, seconds to the first tokens alone)."""
    first = SamplingParams(temperature=0, max_tokens=1)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.chat(convs, first, use_tqdm=False)
    ttft = time.perf_counter() - start
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start, ttft


def measure(llm: LLM, convs: list, batch_1: int, max_tokens: int) -> dict:
    out: dict = {}
    before = llm.engine.stats().spec_decoding
    tokens, seconds, ttft = [], 0.0, 0.0
    for conv in convs[:batch_1]:
        t, s, f = run(llm, [conv], max_tokens)
        tokens += t
        seconds += s
        ttft += f
    n = sum(len(t) for t in tokens)
    out["batch_1"] = dict(tokens=n, seconds=seconds, decode_tok_s=(n - batch_1) / (seconds - ttft))
    out["batch_1"]["_tokens"] = tokens
    after = llm.engine.stats().spec_decoding
    drafts = after.num_drafts - before.num_drafts
    if drafts:
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        out["batch_1"]["mean_acceptance_length"] = 1 + accepted / drafts
    t, s, f = run(llm, convs, max_tokens)
    n = sum(len(x) for x in t)
    out[f"batch_{len(convs)}"] = dict(
        tokens=n, seconds=s, decode_tok_s=(n - len(convs)) / (s - f), _tokens=t
    )
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    """The flags this script shares with spec_policy_ab.py."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--head", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--quantization",
        help="the model's weights (the demo GGUF's are kept 4-bit on the CPU, whose kernel's "
        "rounding differs between a one-token step and a verification's: `float` for equal "
        "tokens)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    parser.add_argument("--batch-1-prompts", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    convs = read_prompts(args.prompts)
    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k}
    results = {}
    runs = (
        ("plain", {}),
        ("eagle3", {"speculative_config": spec | {"adaptive": False}}),
        ("eagle3_adaptive", {"speculative_config": spec}),
    )
    for name, extra in runs:
        llm = LLM(args.model, quantization=args.quantization, **ENGINE, **extra)
        run(llm, convs[:2], 8)  # first calls' one-time costs
        results[name] = measure(llm, convs, args.batch_1_prompts, args.max_tokens)
        policy = llm.engine.scheduler.speculation
        if policy is not None and policy.adaptive:  # tok/s by "batch size:drafts verified"
            results[name]["policy_rates"] = policy.rates()
        llm.engine.shutdown()
    # Greedy tokens equal, per batch size (a float32 step of another shape may round a
    # near-tie the other way: counted, not hidden).
    same = {}
    for name, _ in runs[1:]:
        for key in results["plain"]:
            a, b = results["plain"][key]["_tokens"], results[name][key].pop("_tokens")
            same[f"{name}.{key}"] = (
                f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} sequences"
            )
    for key in results["plain"]:
        results["plain"][key].pop("_tokens")
    report = {
        "model": args.model,
        "head": args.head,
        "num_speculative_tokens": args.k,
        "prompts": len(convs),
        "max_tokens": args.max_tokens,
        "quantization": args.quantization,
        "same_tokens": same,
        "machine": f"{platform.processor() or platform.machine()}, {jax.devices()[0].platform}",
        **results,
        "speedup": {
            f"{name}.{key}": results[name][key]["decode_tok_s"]
            / results["plain"][key]["decode_tok_s"]
            for name, _ in runs[1:]
            for key in results["plain"]
        },
    }
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
