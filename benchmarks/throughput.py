"""Offline throughput through `LLM.generate`, printed as JSON: `jaxllm bench throughput`'s
measurement (`jaxllm/bench/throughput.py`) with more detail, and a transformers baseline.

    .venv/bin/python benchmarks/throughput.py [--model smollm2-135m] [--num-requests 64] \
        [--input-len 128] [--output-len 128] [--dtype float32] [--hf]

N requests of random token ids (seeded) with fixed input/output lengths, greedy, ignore_eos,
so every run does the same work. Reports output tokens/s, total tokens/s, the number of
compiled programs, warmup time, and the host time per step spent scheduling and building the
padded batch next to the whole step. With --hf (needs torch and transformers) it also runs
Hugging Face `generate` with a static batch of all N requests on the same weights, in the
same process, and reports the ratio of output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from jaxllm import LLM
from jaxllm.bench.throughput import measure, random_token_prompts


def run_jaxllm(args) -> tuple[dict, list[list[int]]]:
    """`jaxllm bench throughput`'s measurement, with the host time per step; also returns the
    prompts (random ids of the model's vocabulary) for transformers to run."""
    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    startup = time.perf_counter() - start
    runner, scheduler = llm.runner, llm.engine.scheduler
    compiles_after_warmup = runner.num_compilations

    host = {"schedule": 0.0, "prepare": 0.0}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                host[key] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(scheduler, "schedule", "schedule")
    timed(runner, "prepare", "prepare")
    prompts = random_token_prompts(
        args.num_requests, args.input_len, llm.model_config.vocab_size, seed=0
    )
    res = measure(llm, prompts, args.output_len, use_tqdm=False)
    elapsed, steps = res["elapsed_time"], res["num_steps"]
    return {
        "startup_s": round(startup, 2),
        "warmup_s": round(llm.warmup_seconds or 0.0, 2),
        "compiled_programs": runner.num_programs,
        "compilations_after_warmup": runner.num_compilations - compiles_after_warmup,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(res["output_tokens_per_second"], 1),
        "total_tokens_per_s": round(res["tokens_per_second"], 1),
        "steps": steps,
        "host_ms_per_step": round(1e3 * (host["schedule"] + host["prepare"]) / max(steps, 1), 3),
        "step_ms": round(1e3 * elapsed / max(steps, 1), 2),
    }, prompts


def run_hf(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.model_files import resolve_model

    path = resolve_model(args.model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        path.parent if kwargs else path, dtype=torch.float32, **kwargs
    ).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - t
    out_tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((ids.numel() + out_tokens) / elapsed, 1),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf", action="store_true", help="also run transformers generate")
    args = p.parse_args()

    jaxllm_result, prompts = run_jaxllm(args)
    result = {
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "model": args.model,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "jaxllm": jaxllm_result,
    }
    if args.hf:
        result["hf_transformers"] = run_hf(args, prompts)
        result["speedup_output_tokens"] = round(
            result["jaxllm"]["output_tokens_per_s"]
            / result["hf_transformers"]["output_tokens_per_s"],
            2,
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
