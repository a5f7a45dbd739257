"""jaxllm beside its peers, from one run: the same prompt token ids through jaxllm, Hugging Face
transformers (when torch is installed) and llama-cpp-python (when installed).

    .venv/bin/python benchmarks/compare.py [--model smollm2-135m] [--dtype float32] \
        [--batches 1,16,64] [--input-len 128] [--output-len 128] \
        [--ttft-lens 128,1024,4096] [--repeats 2] [--engines jaxllm,transformers,llama_cpp] \
        [--hf-dtype float32] \
        [--json benchmarks/results/compare-<device>.json]

What it runs, per engine, every prompt `--input-len` random token ids (seeded, the same for
every engine), every request exactly `--output-len` tokens (EOS ignored):
- batch B in `--batches`, greedy: output tok/s end to end (B x output-len / wall time of the
  whole generate call, prefill included). Batch 1 also gives TTFT and the decode rate
  ((output-len - 1) / (wall - TTFT)), and a sampled run (temperature 0.7, top_p 0.9).
- TTFT of one prompt of each length in `--ttft-lens`: the wall time of a one-token generate.
Peers: transformers runs `model.generate` with a static batch of B prompts (no padding needed:
equal lengths) on the same weights (the GGUF dequantized by transformers, in `--dtype`);
`--hf-dtype` gives transformers another dtype than jaxllm's (e.g. jaxllm in bfloat16 against
transformers in float32); llama-cpp-python runs the GGUF file itself (its own quantization, e.g. Q4_1 for the demo
model, so it reads ~5x fewer bytes a token than f32) with `n_threads` = the CPU count, batch 1
only (its Python API decodes one sequence at a time).

`jaxllm:<quantization>` in `--engines` runs jaxllm with that `quantization` (float, gguf, int8,
int4, fp8; plain `jaxllm` is the default, which keeps a GGUF file's quantized tensors), and
`jaxllm:<quantization>/<kv_cache_dtype>` with that KV cache too: e.g.
`--engines jaxllm:float,jaxllm:int8,jaxllm:int4,jaxllm:float/int8,transformers`. Every jaxllm engine is compared
with every peer, and with `jaxllm:float` when that runs too.

Each engine runs in a process of its own (sharing one, they slowed each other: idle threads of
one engine spin on the cores the other needs). They take turns for each measurement (jaxllm,
then each peer), `--repeats` times after one warm-up call, and each
figure is the best of its repeats (highest tok/s, lowest TTFT): on a shared machine the noise
only ever slows a run down. Ratios are jaxllm over each peer, from this one run. jaxllm's
prefix cache is reset before every measurement, so each one computes its whole prompt. Every
engine's process starts with the glibc malloc settings of `jaxllm.host_memory` (as `jaxllm
serve` starts its core), recorded in the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import time

import numpy as np

from jaxllm import host_memory
from jaxllm.bench import cpu_name

SAMPLED = {"temperature": 0.7, "top_p": 0.9}


class Jaxllm:
    name = "jaxllm"

    def __init__(self, args, variant: str | None = None):
        from jaxllm import LLM

        start = time.perf_counter()
        quantization, _, kv_cache_dtype = (variant or "").partition("/")
        self.quantization = quantization or None
        self.kv_cache_dtype = kv_cache_dtype or "auto"
        self.llm = LLM(
            args.model,
            dtype=args.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=max(args.ttft_lens + [args.input_len]) + args.output_len,
            max_num_seqs=max(args.batches),
        )
        self.startup_s = time.perf_counter() - start
        self.compiled = self.llm.runner.num_compilations

    def generate(self, prompts: list[list[int]], max_tokens: int, sampled: bool) -> float:
        from jaxllm import SamplingParams

        # Greedy is temperature 0: SamplingParams' default temperature (1.0, as vLLM's) samples.
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=0,
            **(SAMPLED if sampled else {"temperature": 0.0}),
        )
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    def info(self) -> dict:
        import jax

        return {
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "startup_s": round(self.startup_s, 1),
            "compiled_programs": self.llm.runner.num_programs,
            "compilations_after_warmup": self.llm.runner.num_compilations - self.compiled,
            "attention_backend": self.llm.attention_backend,
            "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        }


class Transformers:
    name = "transformers"

    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM

        from jaxllm.model_files import resolve_model

        self.torch = torch
        path = resolve_model(args.model)
        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent if kwargs else path, dtype=getattr(torch, args.hf_dtype), **kwargs
        ).eval()

    def generate(self, prompts: list[list[int]], max_tokens: int, sampled: bool) -> float:
        torch = self.torch
        ids = torch.tensor(prompts)
        extra = {"do_sample": True, **SAMPLED, "top_k": 0} if sampled else {"do_sample": False}
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
                **extra,
            )
            elapsed = time.perf_counter() - start
        assert out.shape[1] - ids.shape[1] == max_tokens
        return elapsed

    def info(self) -> dict:
        return {"torch_threads": self.torch.get_num_threads(), "version": self.torch.__version__}


class LlamaCpp:
    name = "llama_cpp"
    max_batch = 1

    def __init__(self, args):
        import llama_cpp

        from jaxllm.model_files import resolve_model

        path = resolve_model(args.model)
        if path.suffix != ".gguf":
            raise ValueError("llama_cpp needs a GGUF model")
        self.threads = os.cpu_count() or 1
        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(
            str(path),
            n_ctx=max(args.ttft_lens + [args.input_len]) + args.output_len + 8,
            n_batch=512,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            seed=0,
            verbose=False,
        )
        self.quantization = path.stem.rsplit(".", 1)[-1]

    def generate(self, prompts: list[list[int]], max_tokens: int, sampled: bool) -> float:
        (prompt,) = prompts
        self.llm.reset()
        if sampled:  # only temperature and top-p, like the other engines
            kwargs = {"temp": SAMPLED["temperature"], "top_p": SAMPLED["top_p"], "top_k": 0}
            kwargs["min_p"] = 0.0
        else:
            kwargs = {"temp": 0.0}
        start = time.perf_counter()
        n = 0
        for _ in self.llm.generate(prompt, reset=True, **kwargs):
            n += 1
            if n == max_tokens:
                break
        return time.perf_counter() - start

    def info(self) -> dict:
        return {"threads": self.threads, "version": self.version, "weights": self.quantization}


ENGINES = {"jaxllm": ("jax", Jaxllm), "transformers": ("torch", Transformers)}
ENGINES["llama_cpp"] = ("llama_cpp", LlamaCpp)


def _worker(name: str, args, conn) -> None:
    """One engine in a process of its own, running the generate calls the parent sends."""
    base, _, variant = name.partition(":")
    engine = ENGINES[base][1](args, *([variant] if variant else []))
    conn.send(("ready", getattr(engine, "max_batch", None)))
    while (job := conn.recv()) is not None:
        conn.send(engine.generate(*job))
    conn.send(engine.info())


class Remote:
    """An engine in a child process: engines sharing a process slow each other down (each
    one's idle threads spin or hold cores), so each gets its own, and they take turns."""

    def __init__(self, name: str, args):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(name, args, child), daemon=True)
        self.proc.start()
        _, self.max_batch = self.conn.recv()

    def generate(self, prompts, max_tokens: int, sampled: bool) -> float:
        self.conn.send((prompts, max_tokens, sampled))
        return self.conn.recv()

    def close(self) -> dict:
        self.conn.send(None)
        info = self.conn.recv()
        self.proc.join()
        return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hf-dtype", help="transformers' dtype (default: --dtype)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-lens", default="128,1024,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default="jaxllm,transformers,llama_cpp")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    args.hf_dtype = args.hf_dtype or args.dtype
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ttft_lens = [int(n) for n in args.ttft_lens.split(",") if n]
    wanted = args.engines.split(",")
    # Every engine's process starts with the malloc settings `jaxllm serve` gives its core.
    host_memory.set_for_children()

    engines, skipped = [], {}
    for name in wanted:
        base, _, variant = name.partition(":")
        if base not in ENGINES or (variant and base != "jaxllm"):
            raise SystemExit(f"--engines: unknown engine {name!r}, pick from {list(ENGINES)}")
        module = ENGINES[base][0]
        if importlib.util.find_spec(module) is None:
            skipped[name] = f"{module} is not installed"
            continue
        engines.append(Remote(name, args))

    rng = np.random.default_rng(0)
    vocab = 40000  # ids every tokenizer of the demo model family knows
    batch_prompts = rng.integers(10, vocab, (max(args.batches), args.input_len)).tolist()
    ttft_prompts = {n: rng.integers(10, vocab, n).tolist() for n in args.ttft_lens}

    def best(engine, prompts, max_tokens, sampled=False) -> float:
        engine.generate(prompts, max_tokens, sampled)  # warm: allocations, caches, threads
        return min(engine.generate(prompts, max_tokens, sampled) for _ in range(args.repeats))

    results: dict[str, dict] = {e.name: {} for e in engines}
    out_len = args.output_len
    for b in args.batches:
        for sampled in (False, True) if b == 1 else (False,):
            key = f"batch_{b}" + ("_sampled" if sampled else "")
            for e in engines:
                if e.max_batch is not None and b > e.max_batch:
                    continue
                prompts = batch_prompts[:b]
                wall = best(e, prompts, out_len, sampled)
                row = {"wall_s": round(wall, 3), "output_tok_per_s": round(b * out_len / wall, 1)}
                if b == 1:
                    ttft = best(e, prompts, 1, sampled)
                    row["ttft_s"] = round(ttft, 4)
                    row["decode_tok_per_s"] = round((out_len - 1) / max(wall - ttft, 1e-9), 1)
                results[e.name][key] = row
                print(f"{key:<16} {e.name:<13} {row}", flush=True)
    for n in args.ttft_lens:
        for e in engines:
            ttft = best(e, [ttft_prompts[n]], 1)
            results[e.name][f"ttft_{n}"] = {"ttft_s": round(ttft, 4)}
            print(f"{'ttft_' + str(n):<16} {e.name:<13} {ttft:.4f} s", flush=True)

    ratios = {}
    ours_names = [n for n in results if n.partition(":")[0] == "jaxllm"]
    peers = [n for n in results if n not in ours_names]
    if "jaxllm:float" in results:
        peers.append("jaxllm:float")
    for name in ours_names:
        ours = results[name]
        for peer in peers:
            if peer == name:
                continue
            tag = f"{'' if name == 'jaxllm' else name.partition(':')[2] + '_'}vs_{peer.replace('jaxllm:', '')}"
            for key, row in results[peer].items():
                if key not in ours:
                    continue
                if "output_tok_per_s" in row:
                    r = ours[key]["output_tok_per_s"] / row["output_tok_per_s"]
                    ratios[f"{key}_tok_per_s_{tag}"] = round(r, 2)
                if "decode_tok_per_s" in row:
                    r = ours[key]["decode_tok_per_s"] / row["decode_tok_per_s"]
                    ratios[f"{key}_decode_{tag}"] = round(r, 2)
                if "ttft_s" in row:  # > 1: jaxllm's first token comes sooner
                    ratios[f"{key}_ttft_speedup_{tag}"] = round(
                        row["ttft_s"] / ours[key]["ttft_s"], 2
                    )
    infos = {e.name: e.close() for e in engines}
    report = {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "model": args.model,
        "dtype": args.dtype,
        "transformers_dtype": args.hf_dtype,
        "input_len": args.input_len,
        "output_len": out_len,
        "repeats": args.repeats,
        "engines": infos,
        "skipped": skipped,
        "results": results,
        "ratios": ratios,
    }
    print(
        json.dumps({"ratios": ratios, "engines": report["engines"], "skipped": skipped}, indent=2)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
