"""`jaxllm bench throughput`: offline throughput of `LLM.generate`, as `vllm bench throughput`.

    jaxllm bench throughput --model smollm2-135m [--input-len 128] [--output-len 128] \
        [--num-prompts 64] [--seed 0] [--output-json out.json] [engine flags]

--num-prompts requests of --input-len random token ids (seeded by --seed) that each generate
exactly --output-len tokens (greedy, ignore_eos) go to one `LLM.generate` call after the
engine's warmup, so every run does the same work. --max-model-len defaults to input + output
length here. Prints vLLM's line

    Throughput: X requests/s, Y total tokens/s, Z output tokens/s

and the token totals; --output-json writes vLLM's fields with the engine arguments, the
device, the engine steps and the programs compiled during the run (none, once warm).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from jaxllm.bench import write_json
from jaxllm.config import EngineConfig
from jaxllm.config import add_cli_args as add_engine_args


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_shared_args(p, input_len=128)
    p.add_argument("--dataset-name", choices=("random",), default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default: %(default)s)")


def add_shared_args(p: argparse.ArgumentParser, *, input_len: int) -> None:
    """The flags of `bench throughput` and `bench latency`: the engine's, the lengths, the
    output."""
    add_engine_args(p, model_flag=True)  # --seed among them: it seeds the prompts too
    p.add_argument(
        "--input-len", type=int, default=input_len, help="tokens per prompt (default: %(default)s)"
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens generated per prompt (default: %(default)s)",
    )
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the result here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags' config; --max-model-len unset is the longest request's length."""
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    config = EngineConfig.from_cli(args)
    if args.max_model_len is None:
        config = config.replace(max_model_len=args.input_len + args.output_len)
    return config


def random_token_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` random token ids, skipping the lowest ids (often special)."""
    rng = np.random.default_rng(seed)
    low = min(10, vocab_size - 1)
    return rng.integers(low, vocab_size, size=(num, length)).tolist()


def measure(llm, prompts: list[list[int]], output_len: int, *, use_tqdm: bool, params=None) -> dict:
    """Generates `output_len` tokens for every prompt in one `generate` call, timed: greedy,
    or as `params` (a SamplingParams) sample, ignoring EOS either way."""
    import dataclasses

    from jaxllm import SamplingParams

    params = params or SamplingParams(temperature=0)
    params = dataclasses.replace(params, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()  # a repeated run must prefill again
    steps, compilations = llm.engine.num_steps, llm.runner.num_compilations
    spec_before = llm.engine.stats().spec_decoding
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = num_prompt_tokens + num_output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(prompts),
        "total_num_tokens": total,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens,
        "requests_per_second": len(prompts) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "num_steps": llm.engine.num_steps - steps,
        "compilations_during_run": llm.runner.num_compilations - compilations,
        **spec_decode(llm, spec_before),
    }


def spec_decode(llm, before) -> dict:
    """With speculative decoding, what it did since `before` (a `SpecDecodingStats`), as `vllm
    bench serve` reports it: {"spec_decode": {...}}; else {}."""
    spec = llm.config.speculative.method
    if spec is None:
        return {}
    after, k = llm.engine.stats().spec_decoding, spec.num_speculative_tokens
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [
        (after.num_accepted_per_pos[j] if j < len(after.num_accepted_per_pos) else 0)
        - (before.num_accepted_per_pos[j] if j < len(before.num_accepted_per_pos) else 0)
        for j in range(k)
    ]
    return {
        "spec_decode": {
            "method": spec.method,
            "num_speculative_tokens": k,
            "adaptive": spec.adaptive,
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "per_position_acceptance_rate": [a / drafts if drafts else None for a in per_pos],
        }
    }


def print_spec_decode(res: dict) -> None:
    """The speculative decoding section of a result, as `vllm bench serve` prints it."""
    spec = res.get("spec_decode")
    if spec is None:
        return
    print("{s:{c}^50}".format(s=" Speculative Decoding ", c="-"))

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.2f}"

    length = spec["acceptance_length"]
    print(f"{'Acceptance rate (%):':<40}{pct(spec['acceptance_rate']):>10}")
    print(f"{'Acceptance length:':<40}{'n/a' if length is None else f'{length:.2f}':>10}")
    print(f"{'Drafts:':<40}{spec['drafts']:>10}")
    print(f"{'Draft tokens:':<40}{spec['draft_tokens']:>10}")
    print(f"{'Accepted tokens:':<40}{spec['accepted_tokens']:>10}")
    print("Per-position acceptance (%):")
    for j, rate in enumerate(spec["per_position_acceptance_rate"]):
        print(f"{f'  Position {j}:':<40}{pct(rate):>10}")


def describe(llm, args: argparse.Namespace) -> dict[str, Any]:
    """What was measured, saved beside the numbers: the engine's arguments and the device."""
    import jax

    return {
        "model": str(args.model),
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "engine_args": llm.config.flat(),
        "warmup_s": llm.warmup_seconds,
    }


def run(llm, args: argparse.Namespace) -> dict:
    prompts = random_token_prompts(
        args.num_prompts, args.input_len, llm.model_config.vocab_size, args.seed
    )
    res = measure(llm, prompts, args.output_len, use_tqdm=not args.disable_tqdm)
    print(
        f"Throughput: {res['requests_per_second']:.2f} requests/s, "
        f"{res['tokens_per_second']:.2f} total tokens/s, "
        f"{res['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {res['total_prompt_tokens']}")
    print(f"Total num output tokens:  {res['total_output_tokens']}")
    print_spec_decode(res)
    res = {
        **describe(llm, args),
        "input_len": args.input_len,
        "output_len": args.output_len,
        **res,
    }
    if args.output_json:
        write_json(args.output_json, res)
    return res
