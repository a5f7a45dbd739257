"""`jaxllm bench latency`: the latency of one batch through `LLM.generate`, as
`vllm bench latency`.

    jaxllm bench latency --model smollm2-135m [--input-len 32] [--output-len 128] \
        [--batch-size 8] [--num-iters-warmup 10] [--num-iters 30] [--output-json out.json] \
        [engine flags]

Each iteration generates --output-len tokens (greedy, ignore_eos) for --batch-size prompts of
--input-len random token ids (seeded by --seed) in one `generate` call, with the prefix cache
emptied first so every iteration prefills. --num-iters-warmup untimed iterations come first.
Prints the mean latency and its 10/25/50/75/90/99th percentiles in seconds, as vLLM does;
--output-json writes them with every latency, the engine arguments and the device.
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm.auto import tqdm

from jaxllm.bench import throughput, write_json
from jaxllm.bench.throughput import describe, measure, random_token_prompts
from jaxllm.config import EngineConfig

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    throughput.add_shared_args(p, input_len=32)
    p.add_argument(
        "--batch-size", type=int, default=8, help="prompts per iteration (default: %(default)s)"
    )
    p.add_argument(
        "--num-iters-warmup", type=int, default=10, help="untimed iterations (default: %(default)s)"
    )
    p.add_argument(
        "--num-iters", type=int, default=30, help="timed iterations (default: %(default)s)"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.batch_size < 1 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size and --num-iters must be >= 1, --num-iters-warmup >= 0")
    return throughput.engine_config(args)


def run(llm, args: argparse.Namespace) -> dict:
    prompts = random_token_prompts(
        args.batch_size, args.input_len, llm.model_config.vocab_size, args.seed
    )

    def iteration() -> float:
        return measure(llm, prompts, args.output_len, use_tqdm=False)["elapsed_time"]

    for _ in tqdm(
        range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm
    ):
        iteration()
    spec_before = llm.engine.stats().spec_decoding
    latencies = [
        iteration()
        for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm)
    ]
    spec = throughput.spec_decode(llm, spec_before)
    values = np.percentile(latencies, PERCENTILES)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for p, v in zip(PERCENTILES, values, strict=True):
        print(f"{p}% percentile latency: {v} seconds")
    res = {
        **describe(llm, args),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, values, strict=True)},
        **spec,
    }
    throughput.print_spec_decode(res)
    if args.output_json:
        write_json(args.output_json, res)
    return res
