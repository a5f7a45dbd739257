"""Where one engine step's milliseconds go, per stage, printed as a table (and JSON).

    .venv/bin/python benchmarks/profile_step.py [--model smollm2-135m] [--batch 1] \
        [--context 128] [--steps 32] [--temperature 0] [--top-p 1] [--dtype float32] \
        [--quantization gguf] [--json PATH]

Runs `--batch` requests of `--context` random prompt tokens (seeded) through `LLM.generate`,
then times `--steps` decode steps (every request decoding one token per step) stage by stage:

    schedule      Scheduler.schedule (host)
    prepare       ModelRunner.update_batch and .prepare: the padded host arrays (host)
    forward       the layers' program, dispatch to result ready (device)
    head+sample   the output head and the sampler, dispatch to result ready (device)
    fetch         device_get of the sampled tokens and the rest of ModelRunner.execute (host)
    update        Scheduler.update_from_output (host)
    output        the rest of the step: detokenizing, building outputs, bookkeeping (host)

Each device stage waits for its result (`block_until_ready`), so the stages add up to the step
and none overlaps another; the engine itself only waits once a step, in `fetch`. The table
shows the median and minimum over the steps; `step` is the whole `LLM` step, and `tok/s` the
decode throughput it implies (batch / median step).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from collections import defaultdict

import jax
import numpy as np

from jaxllm import LLM, SamplingParams

STAGES = ("schedule", "prepare", "forward", "head+sample", "fetch", "update", "output")


def _timed(times: dict[str, list[float]], obj, name, stage: str, *, block: bool = False):
    """Times `obj.name` (or `obj[name]`, `obj` a dict of programs) as `stage`."""
    keyed = isinstance(obj, dict)
    fn = obj[name] if keyed else getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if block:
            jax.block_until_ready(out)
        times[stage].append(time.perf_counter() - start)
        return out

    if keyed:
        obj[name] = wrapper
    else:
        setattr(obj, name, wrapper)


def profile(args) -> dict:
    # Stages are timed one after another, so steps run synchronously (older code has no flag).
    extra = {}
    if "async_scheduling" in inspect.signature(LLM).parameters:
        extra["async_scheduling"] = False
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.context + args.steps + 8 + -(-args.batch * args.context // 512),
        max_num_seqs=max(args.batch, 1),
        attention_backend=args.attention_backend,
        **extra,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    rng = np.random.default_rng(0)
    vocab = llm.runner.config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(10, vocab - 10, args.context).tolist()}
        for _ in range(args.batch)
    ]
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        # enough for every request to reach decoding (prefill chunks of 512 tokens) and then
        # decode --steps tokens together
        max_tokens=args.steps + 2 + -(-args.batch * args.context // 512),
        ignore_eos=True,
        seed=0,
    )
    llm.generate(prompts, params, use_tqdm=False)  # everything warm, caches filled once
    llm.reset_prefix_cache()

    times: dict[str, list[float]] = defaultdict(list)
    runner, scheduler, engine = llm.runner, llm.engine.scheduler, llm.engine
    _timed(times, runner, "prepare", "prepare")
    if hasattr(runner, "update_batch"):  # the persistent batch's diffs count as prepare
        _timed(times, runner, "update_batch", "update_batch")
    if isinstance(getattr(runner, "head_and_sample", None), dict):  # a program per variant
        _timed(times, runner, "forward", "forward", block=True)
        for variant in runner.head_and_sample:
            _timed(times, runner.head_and_sample, variant, "head+sample", block=True)
    elif hasattr(runner, "head_and_sample"):
        _timed(times, runner, "forward", "forward", block=True)
        _timed(times, runner, "head_and_sample", "head+sample", block=True)
    elif hasattr(runner, "_forward"):  # before the worker package (for before/after tables)
        _timed(times, runner, "_forward", "forward", block=True)
        _timed(times, runner, "_sample", "head+sample", block=True)
    else:  # before the step was split in two (for before/after tables): one program
        _timed(times, runner, "_step", "forward", block=True)
    _timed(times, runner, "execute", "execute")
    _timed(times, scheduler, "update_from_output", "update")
    schedule = scheduler.schedule

    def timed_schedule():
        start = time.perf_counter()
        out = schedule()
        times["schedule"].append(time.perf_counter() - start)
        times["num_tokens"].append(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = timed_schedule
    step = engine.step

    def step_started():  # the step's wall time runs from one start to the next
        times["start"].append(time.perf_counter())
        return step()

    engine.step = step_started

    compiled = runner.num_compilations
    llm.generate(prompts, params, use_tqdm=False)
    assert runner.num_compilations == compiled, "a step compiled a program after warmup"

    # Decode steps only (every request scheduled one token), not the last (it ends the run).
    starts = times["start"]
    steps = [
        i for i, n in enumerate(times["num_tokens"]) if n == args.batch and i + 1 < len(starts)
    ][: args.steps]
    sample = times["head+sample"] or [0.0] * len(times["forward"])
    times["head+sample"] = sample
    rows = {}
    for stage in ("schedule", "prepare", "forward", "head+sample", "update"):
        rows[stage] = [times[stage][i] for i in steps]
    if times["update_batch"]:
        rows["prepare"] = [
            p + times["update_batch"][i] for p, i in zip(rows["prepare"], steps, strict=True)
        ]
    rows["fetch"] = [
        times["execute"][i] - rows["prepare"][k] - times["forward"][i] - sample[i]
        for k, i in enumerate(steps)
    ]
    rows["step"] = [starts[i + 1] - starts[i] for i in steps]
    rows["output"] = [
        starts[i + 1] - starts[i] - times["schedule"][i] - times["execute"][i] - times["update"][i]
        for i in steps
    ]
    summary = {
        stage: {"median_ms": 1e3 * float(np.median(v)), "min_ms": 1e3 * float(np.min(v))}
        for stage, v in rows.items()
    }
    step_ms = summary["step"]["median_ms"]
    return {
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "context": args.context,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "attention_backend": llm.attention_backend,
        "device": str(jax.devices()[0].device_kind),
        "decode_steps_timed": len(steps),
        "stages": summary,
        "tok_per_s": args.batch * 1e3 / step_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="decode steps to time")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", help="the engine's quantization (gguf, int8, ...)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    result = profile(args)
    step = result["stages"]["step"]["median_ms"]
    print(
        f"{result['model']} {result['dtype']} batch {args.batch} context {args.context} "
        f"temperature {args.temperature} top_p {args.top_p} "
        f"({result['attention_backend']} attention, {result['device']}): "
        f"{result['decode_steps_timed']} decode steps"
    )
    print(f"{'stage':<12} {'median ms':>10} {'min ms':>8} {'share':>6}")
    for stage in (*STAGES, "step"):
        s = result["stages"][stage]
        print(
            f"{stage:<12} {s['median_ms']:>10.2f} {s['min_ms']:>8.2f} "
            f"{100 * s['median_ms'] / step:>5.0f}%"
        )
    print(f"decode: {result['tok_per_s']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
