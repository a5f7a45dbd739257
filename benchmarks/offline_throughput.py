"""Offline generation throughput: prefill and decode measured separately.

    .venv/bin/python benchmarks/offline_throughput.py [--model smollm2-135m] \
        [--num-prompts 16] [--input-len 128] [--output-len 64]

Random prompts of fixed length (seeded), greedy, ignore_eos, so every run does the same work.
Prefill is timed with max_tokens=1; decode is the rest of a full run. Warm-up runs first so
compile time is reported apart. Also reports the host time per step spent building the batch
(`ModelRunner.prepare`) against the whole step.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args()

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(10, vocab, size=args.input_len).tolist()}
        for _ in range(args.num_prompts)
    ]
    prefill_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full_params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    runner = llm.runner
    prepare = runner.prepare
    host = []

    def timed_prepare(out):
        t = time.perf_counter()
        result = prepare(out)
        host.append(time.perf_counter() - t)
        return result

    runner.prepare = timed_prepare

    t = time.perf_counter()
    llm.generate(prompts, prefill_params, use_tqdm=False)
    llm.generate(prompts, full_params, use_tqdm=False)
    warmup = time.perf_counter() - t
    compiles = runner.num_compilations

    host.clear()
    steps0 = llm.engine.num_steps
    t = time.perf_counter()
    llm.generate(prompts, prefill_params, use_tqdm=False)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, full_params, use_tqdm=False)
    total_s = time.perf_counter() - t
    steps = llm.engine.num_steps - steps0
    decode_s = total_s - prefill_s
    decode_tokens = args.num_prompts * (args.output_len - 1)

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(
        f"model {args.model} dtype {llm.runner.kv_caches[0].dtype}; {args.num_prompts} prompts x "
        f"{args.input_len} in / {args.output_len} out; max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    print(f"warm-up (compiles included): {warmup:.1f} s, {compiles} compilations")
    print(
        f"prefill: {args.num_prompts * args.input_len / prefill_s:,.0f} tok/s ({prefill_s:.2f} s)"
    )
    print(f"decode:  {decode_tokens / decode_s:,.1f} tok/s ({decode_s:.2f} s)")
    print(
        f"host batch building: {1e3 * np.mean(host):.2f} ms/step over {len(host)} steps "
        f"({100 * sum(host) / (prefill_s + total_s):.1f}% of wall time; {steps} steps timed)"
    )
    print(f"compilations after warm-up: {runner.num_compilations - compiles}")


if __name__ == "__main__":
    main()
