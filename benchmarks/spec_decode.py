"""Speculative decoding at batch 1: the engine with and without n-gram speculation, in the
same process, on a prompt whose continuation repeats its own patterns (a JSON list of records,
the next one begun) and on ordinary prose. Printed as JSON (and written to --out).

    .venv/bin/python benchmarks/spec_decode.py [--model smollm2-135m] [--output-len 128] \
        [--k 5] [--lookup-max 4] [--lookup-min 2] [--repeats 3] [--out FILE]

Greedy (a small model's greedy prose soon repeats itself) and, on the prose, seeded sampling
(temperature 0.8, top-p 0.95: text that repeats little); ignore_eos. Both engines produce the
same tokens (checked). Reports the speed of
each (output tokens over the whole `generate`, and decode only: without the time to the first
token; the best of --repeats, prefix cache reset between runs), the speedups, the draft tokens proposed and accepted, and the mean
number of tokens a verification step produced.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax

from jaxllm import LLM, SamplingParams
from jaxllm.bench import write_json

_NAMES = ["Alice", "Bob", "Chen", "Dmitri", "Elena", "Farah", "Goran", "Hana"]
_CITIES = ["Paris", "London", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Seoul"]
JSON_PROMPT = (
    "Here is the customer list as JSON, one record per line:\n[\n"
    + "".join(
        f'  {{"id": {i + 1}, "name": "{n}", "city": "{c}", "active": {str(i % 3 != 0).lower()}}},\n'
        for i, (n, c) in enumerate(zip(_NAMES, _CITIES, strict=True))
    )
    + '  {"id": 9, "name": "'
)

PROSE_PROMPT = (
    "The printing press changed Europe in ways its inventor could not have foreseen. Before "
    "Gutenberg, a book was copied by hand, and a monastery might spend a year on a single "
    "volume. Within fifty years of his first Bible, millions of books were in circulation, "
    "and ideas that once travelled at the pace of a scribe now crossed borders in months. "
    "Historians still argue about"
)


def measure(llm: LLM, prompt: str, params: SamplingParams, repeats: int) -> dict:
    """The best of `repeats` runs; decode speed leaves out the time to the first token (the
    prompt's prefill, the best of as many one-token runs), which speculation does not touch."""
    first = SamplingParams(temperature=0, max_tokens=1)
    ttft = float("inf")
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompt, first, use_tqdm=False)
        ttft = min(ttft, time.perf_counter() - start)
    best, tokens = None, None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        before = llm.engine.stats()
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        elapsed = time.perf_counter() - start
        after = llm.engine.stats()
        if best is None or elapsed < best:
            best = elapsed
            drafts = after.spec_decoding.num_draft_tokens - before.spec_decoding.num_draft_tokens
            accepted = (
                after.spec_decoding.num_accepted_tokens - before.spec_decoding.num_accepted_tokens
            )
            verifications = after.spec_decoding.num_drafts - before.spec_decoding.num_drafts
        tokens = out.token_ids
    result = {
        "tokens_per_s": round(len(tokens) / best, 2),
        "decode_tokens_per_s": round((len(tokens) - 1) / (best - ttft), 2),
        "seconds": round(best, 3),
        "ttft_s": round(ttft, 3),
    }
    if drafts:
        result.update(
            draft_tokens=drafts,
            accepted_tokens=accepted,
            acceptance_rate=round(accepted / drafts, 3),
            tokens_per_verification=round((accepted + verifications) / verifications, 2),
        )
    return result | {"_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    common = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
        "adaptive": False,  # what n-gram drafts give in every step, not the policy's choice
    }
    plain = LLM(args.model, **common)
    ngram = LLM(args.model, speculative_config=spec, **common)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.output_len,
                             ignore_eos=True)  # fmt: skip
    report = {
        "device": f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})",
        "model": args.model,
        "dtype": args.dtype,
        "batch": 1,
        "output_len": args.output_len,
        "speculative_config": spec,
        "compiled_programs": {
            "plain": plain.runner.num_programs,
            "ngram": ngram.runner.num_programs,
        },
        "warmup_s": {
            "plain": round(plain.warmup_seconds, 1),
            "ngram": round(ngram.warmup_seconds, 1),
        },
    }
    compiled = ngram.runner.num_compilations
    cases = (
        ("json", JSON_PROMPT, greedy),
        ("prose", PROSE_PROMPT, greedy),
        ("prose_sampled", PROSE_PROMPT, sampled),
    )
    for name, prompt, params in cases:
        base = measure(plain, prompt, params, args.repeats)
        fast = measure(ngram, prompt, params, args.repeats)
        text = plain.tokenizer.decode(base["_tokens"])
        same = base.pop("_tokens") == fast.pop("_tokens")
        report[name] = {
            "plain": base,
            "ngram": fast,
            "speedup": round(fast["tokens_per_s"] / base["tokens_per_s"], 3),
            "decode_speedup": round(fast["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3),
            "same_tokens": same,
            "continuation": text,
        }
    report["compilations_after_warmup"] = ngram.runner.num_compilations - compiled
    print(json.dumps(report, indent=2))
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
