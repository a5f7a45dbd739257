"""Decode throughput with LoRA adapters against the base model, in one process: a batch of
requests under `--adapters` distinct adapters (spread evenly) against the same batch under
none, on one engine serving LoRA, and the base model on an engine without LoRA.

    .venv/bin/python benchmarks/lora_decode.py [--model smollm2-135m] [--batch 16] \
        [--adapters 4] [--rank 16] [--input-len 128] [--output-len 128] [--json PATH]

The adapters are random PEFT adapters of rank `--rank` on every target (q, k, v, o, gate,
up, down), written as PEFT saves them. Reported: output tokens/s of each run (the median of
`--repeats`, after a warm-up run), and the ratios; greedy, ignore_eos, the same prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.lora import TARGETS, BaseDims


def write_adapter(path: Path, dims: BaseDims, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter on every target of every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for t in TARGETS:
            num_in, num_out = dims.shape(t)
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, num_in)).astype("f4")
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (num_out, rank)).astype("f4")
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def timed(llm: LLM, prompts, params, loras, repeats: int) -> float:
    """Median output tokens/s over `repeats` runs, after one untimed."""
    llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    common = dict(
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(256, args.batch),
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    base_llm = LLM(args.model, **common)
    vocab = base_llm.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()}
        for _ in range(args.batch)
    ]
    base_only = timed(base_llm, prompts, params, None, args.repeats)
    dims = BaseDims.of(base_llm.model_config)
    del base_llm
    llm = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              **common)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", dims, args.rank, i)))
            for i in range(args.adapters)
        ]
        loras = [adapters[i % args.adapters] for i in range(args.batch)]
        compilations = llm.runner.num_compilations
        base_on_lora_engine = timed(llm, prompts, params, None, args.repeats)
        with_adapters = timed(llm, prompts, params, loras, args.repeats)
        compiled_after_warmup = llm.runner.num_compilations - compilations
    report = {
        "args": vars(args),
        "base_tok_s": round(base_only, 1),
        "base_on_lora_engine_tok_s": round(base_on_lora_engine, 1),
        "adapters_tok_s": round(with_adapters, 1),
        "adapters_over_base": round(with_adapters / base_only, 3),
        "adapters_over_base_on_lora_engine": round(with_adapters / base_on_lora_engine, 3),
        "compiled_after_warmup": compiled_after_warmup,
    }
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
