"""Host time per engine step and decode throughput where the host is the bottleneck: a tiny
random model (2 layers, width 64) decoding many requests at once, as a small or medium model
is on an accelerator.

    .venv/bin/python benchmarks/host_step.py [--requests 1 64 256] [--output-len 64] \
        [--against ../old-checkout] [--json PATH]

For each request count, `--requests` prompts of 16 random tokens decode `--output-len` tokens
each (greedy, ignore_eos) through `LLM.generate`, after a warm-up run of the same batch.
Reported per request count:

    host_ms     schedule + prepare + update per step (the scheduler, the runner's host-side
                batch building, and the scheduler's update from the step's output), median
    step_ms     the whole step, median
    tok_per_s   output tokens per second of the timed `generate`
    steps_per_s engine steps per second

This checkout runs with async scheduling on and off. `--against DIR` runs the same
measurement on the jaxllm checked out in DIR (e.g. the commit before a change, `git worktree
add ../old <commit>`), taking turns with this one in fresh processes, and prints the ratios:
every side from one run, on the same machine. With async scheduling, `host_ms` overlaps the
device's work; `step_ms` is the time between two steps' returns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def write_tiny_model(path: Path, vocab_size: int = 512) -> Path:
    """A random 2-layer Llama checkpoint in Hugging Face layout with a word-level tokenizer."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"})
    )
    d, f, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(vocab_size, d),
        "model.norm.weight": np.ones(d, np.float32),
        "lm_head.weight": w(vocab_size, d),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": w(heads * head_dim, d),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": w(d, heads * head_dim),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _wrap(times: dict[str, list[float]], obj, name: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - start)
        return out

    setattr(obj, name, timed)


def measure(model: str, num_requests: int, output_len: int, async_scheduling: str) -> dict:
    """One request count, in this process, with whatever `jaxllm` imports."""
    from jaxllm import LLM, SamplingParams

    extra = {} if async_scheduling == "default" else {"async_scheduling": async_scheduling == "on"}
    llm = LLM(
        model,
        max_model_len=16 + output_len + 16,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(512, num_requests),
        compilation_cache_dir=None,
        **extra,
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 500, 16).tolist()} for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm

    times: dict[str, list[float]] = defaultdict(list)
    runner, scheduler, engine = llm.runner, llm.engine.scheduler, llm.engine
    for obj, name in (
        (scheduler, "schedule"),
        (scheduler, "update_from_output"),
        (runner, "prepare"),
        (runner, "update_batch"),  # the persistent batch's diffs (absent in older code)
        (engine, "step"),
    ):
        if hasattr(obj, name):
            _wrap(times, obj, name)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = len(times["step"])
    host = [
        sum(times[name][i] for name in times if name != "step" and i < len(times[name]))
        for i in range(steps)
    ]
    return {
        "requests": num_requests,
        "host_ms": 1e3 * float(np.median(host)),
        "step_ms": 1e3 * float(np.median(times["step"])),
        "tok_per_s": tokens / elapsed,
        "steps_per_s": steps / elapsed,
        "steps": steps,
        "jaxllm": str(Path(__import__("jaxllm").__file__).parent.parent),
    }


def _run_child(checkout: Path, model: str, n: int, output_len: int, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, str(HERE), "--child", model, str(n), str(output_len), mode],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{checkout}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, n, output_len, mode = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(measure(model, n, output_len, mode)))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--against", type=Path, help="another jaxllm checkout to compare with")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    # (checkout, async scheduling): this code with it on and off, the other as it comes
    sides = {"async": (HERE.parent.parent, "on"), "sync": (HERE.parent.parent, "off")}
    if args.against:
        sides["against"] = (args.against.resolve(), "default")
    results: dict = {
        "output_len": args.output_len,
        "sides": {k: [str(c), mode] for k, (c, mode) in sides.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny-llama"))
        for n in args.requests:
            row = {}
            for side, (checkout, mode) in sides.items():  # in turns, each in a fresh process
                row[side] = _run_child(checkout, model, n, args.output_len, mode)
                print(side, json.dumps(row[side]), flush=True)
            row["async_over_sync_tok_per_s"] = row["async"]["tok_per_s"] / row["sync"]["tok_per_s"]
            if "against" in row:
                for side in ("async", "sync"):
                    row[f"{side}_over_against_tok_per_s"] = (
                        row[side]["tok_per_s"] / row["against"]["tok_per_s"]
                    )
                    row[f"{side}_over_against_host_ms"] = (
                        row[side]["host_ms"] / row["against"]["host_ms"]
                    )
            results[str(n)] = row
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
