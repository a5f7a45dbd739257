"""The peer measured beside jaxllm on the same GPU: transformers on the machine's own torch,
with a static KV cache and `torch.compile(mode="reduce-overhead")` (CUDA graphs), decoding an
8B-shaped model with random bfloat16 weights.

    python benchmarks/torch_peer.py [--config benchmarks/configs/llama-3.1-8b] \
        [--batches 1,64] [--input-len 128] [--output-len 128] [--mode reduce-overhead] \
        [--json PATH]
    python benchmarks/torch_peer.py --config DIR --device cpu --mode default   # a smoke run

For each batch size: `--batches` prompts of `--input-len` random tokens, greedy, every one
`--output-len` tokens long (`min_new_tokens`), through `generate` with
`cache_implementation="static"` and the decode step compiled by transformers as `--mode` says
("none": eager; "default" for a CPU smoke run, where CUDA graphs do not exist).
Two untimed runs compile (and capture the graphs); then the medians of three runs of 1 and of
`--output-len` new tokens give decode ms per step from their difference, as
`e2e_vs_transformers.py` measures jaxllm: decode tok/s = batch / step. The weights are drawn on
the device (`from_config`), never downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def measure(args, on_batch=None) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    gen = model.generation_config
    gen.cache_implementation = "static"
    gen.pad_token_id = 0
    # transformers compiles the decode step itself when the cache is static (the prompt's
    # forward stays eager), as its docs advise: that is the peer, with our mode and fullgraph.
    if args.mode == "none":
        gen.disable_compile = True
    else:
        gen.compile_config = CompileConfig(mode=args.mode, fullgraph=True)
        gen.compile_config._compile_all_devices = device != "cuda"  # a CPU smoke run compiles

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    results = {}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "results": results}
    report["transformers"] = __import__("transformers").__version__
    for batch in args.batches:
        ids = torch.randint(100, config.vocab_size - 1, (batch, args.input_len), device=device)

        def run(n: int, ids=ids) -> float:
            sync()
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True
                )
            sync()
            return time.perf_counter() - start

        for n in (args.output_len, 1):  # compiles, captures the graphs
            run(n)
            run(n)
        one = statistics.median(run(1) for _ in range(3))
        full = statistics.median(run(args.output_len) for _ in range(3))
        step = (full - one) / (args.output_len - 1)
        results[str(batch)] = {
            "decode_ms_per_step": 1e3 * step,
            "decode_tok_per_s": batch / step,
            "output_tok_per_s": batch * args.output_len / full,
            "first_token_s": one,
        }
        print(
            f"batch {batch:>4}: decode {1e3 * step:.2f} ms/step, {batch / step:,.0f} tok/s; "
            f"{batch * args.output_len / full:,.0f} output tok/s",
            flush=True,
        )
        if on_batch is not None:  # what was measured survives a stage's time limit
            on_batch(report)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=Path("benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", default="reduce-overhead", help="torch.compile mode, or none")
    p.add_argument("--device", default=None)
    p.add_argument("--json")
    args = p.parse_args()

    def save(report: dict) -> None:
        if args.json:
            from jaxllm.bench import write_json

            write_json(args.json, {**report, "args": {k: str(v) for k, v in vars(args).items()}})

    save(measure(args, on_batch=save))


if __name__ == "__main__":
    main()
