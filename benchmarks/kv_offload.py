"""Returning conversations through a device KV pool too small for them, with and without the
prefix cache's host-RAM tier (`kv_offloading_size`), in one process: time to first token of
the turns that return, and that both give the same tokens.

    .venv/bin/python benchmarks/kv_offload.py [--model smollm2-135m] [--conversations 8] \
        [--rounds 3] [--first-turn 512] [--num-pages 64] [--kv-offloading-size 1] [--json PATH]

Each conversation starts with `--first-turn` random token ids; every round, each conversation
in turn sends its history plus `--user-tokens` new ones: first with max_tokens=1 (timed: the
time to its first token, through `LLM.generate`), then again for `--reply-tokens` greedy
tokens (a device-cache hit), which join the history. The pool (`--num-pages`) holds about one
conversation, so by the time one returns its blocks have left the device: without the tier
its history is recomputed, with it the blocks are copied back from host memory. Reported:
the median and mean TTFT of the returning turns (rounds after the first) on each side, their
ratio, the host tier's counters and memory, compilations after warmup, and whether every
reply was the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxllm import LLM, SamplingParams


def run(args, offloading: float) -> dict:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_pages=args.num_pages,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_offloading_size=offloading,
    )
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(0)
    histories = [
        rng.integers(3, vocab, args.first_turn).tolist() for _ in range(args.conversations)
    ]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reply = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    compilations = llm.runner.num_compilations
    ttft: list[list[float]] = []
    replies = []
    for _ in range(args.rounds):
        times = []
        for history in histories:
            history += rng.integers(3, vocab, args.user_tokens).tolist()
            start = time.perf_counter()
            llm.generate({"prompt_token_ids": history}, first, use_tqdm=False)
            times.append(time.perf_counter() - start)
            out = llm.generate({"prompt_token_ids": history}, reply, use_tqdm=False)
            tokens = out[0].outputs[0].token_ids
            replies.append(tokens)
            history += tokens
        ttft.append(times)
    returning = [t for times in ttft[1:] for t in times]
    stats = llm.engine.stats()
    result = {
        "kv_offloading_size_gib": offloading,
        "ttft_returning_median_s": round(statistics.median(returning), 4),
        "ttft_returning_mean_s": round(statistics.mean(returning), 4),
        "ttft_first_round_median_s": round(statistics.median(ttft[0]), 4),
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_hits_host": stats.prefix_cache_hits_host,
        "kv_offload_stored_blocks": stats.kv_offload_stored,
        "kv_offload_loaded_blocks": stats.kv_offload_loaded,
        "host_tier_blocks": stats.kv_offload_blocks,
        "host_tier_capacity_blocks": stats.kv_offload_capacity,
        "host_tier_bytes": llm.runner.offloader.host_bytes if llm.runner.offloader else 0,
        "compiled_after_warmup": llm.runner.num_compilations - compilations,
    }
    return result, replies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-turn", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--num-pages", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--kv-offloading-size", type=float, default=1.0)
    p.add_argument("--json")
    args = p.parse_args()
    off, off_replies = run(args, 0.0)
    print("off", json.dumps(off), flush=True)
    on, on_replies = run(args, args.kv_offloading_size)
    print("on ", json.dumps(on), flush=True)
    report = {
        "args": vars(args),
        "off": off,
        "on": on,
        "ttft_speedup_median": round(
            off["ttft_returning_median_s"] / on["ttft_returning_median_s"], 2
        ),
        "ttft_speedup_mean": round(off["ttft_returning_mean_s"] / on["ttft_returning_mean_s"], 2),
        "same_replies": off_replies == on_replies,
    }
    print(json.dumps({k: report[k] for k in ("ttft_speedup_median", "same_replies")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
