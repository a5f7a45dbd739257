"""An 8B-shaped model end to end on an accelerator: greedy tokens and prompt logprobs against
transformers on torch, then decode speed with the full model's weights.

    python benchmarks/e2e_vs_transformers.py [--config benchmarks/configs/llama-3.1-8b] \
        [--parity-layers 2] [--dtypes float32,bfloat16] [--batches 1,64] [--json PATH]

1. Parity. The config's widths (hidden, heads, vocab, rope) with `--parity-layers` layers:
   transformers draws random weights (torch seed 0, the config's initializer_range), rounded
   to bfloat16 and saved as safetensors. In a subprocess, transformers (torch, on the GPU when
   there is one, TF32 off) generates `--max-tokens` greedy tokens for each prompt (random
   token ids of several lengths) and scores every prompt token; then jaxllm loads the same
   files in each of `--dtypes` and does the same. Reported per dtype: prompts whose greedy
   tokens match exactly, the first differing step otherwise, the largest |difference| of a
   prompt token's logprob, and the share of prompt positions whose most likely next token
   agrees. float32 runs with JAX's matmul precision "highest" (torch's float32 matmuls are
   exact here too), so it should match token for token; bfloat16 rounds differently in each
   framework, so random weights (whose top two logits are close) may part after some steps.
2. Speed. The whole config (all its layers) with random weights made on the device
   (`load_format="dummy"`), in bfloat16: for each batch size, `--input-len` prompt tokens and
   `--output-len` greedy tokens, timed after an untimed run that compiles; decode ms per step
   from the difference between a 1-token and an `--output-len`-token run.

Needs torch and transformers (the test extras) for part 1; `--skip-parity` runs part 2 alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_LENS = (5, 37, 200, 700)
SEED = 0


def reference(model_dir: Path, config_dir: Path, layers: int, out: Path, max_tokens: int) -> None:
    """The subprocess: random weights saved to `model_dir`, transformers' answers to `out`."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(config_dir)
    config.num_hidden_layers = layers
    torch.manual_seed(SEED)
    # Made in float32 and rounded to bfloat16 values, parameters only: casting the whole
    # module (`.to(bfloat16)`) would also round its rotary inv_freq buffer, which a model
    # loaded with `from_pretrained(dtype=bfloat16)` keeps in float32.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    state = {k: v.bfloat16() for k, v in model.state_dict().items()}
    config.torch_dtype = "bfloat16"
    model.save_pretrained(model_dir, state_dict=state, safe_serialization=True)
    del state
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENS]
    answers = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for dtype in ("float32", "bfloat16"):
        if dtype == "bfloat16":  # as a user loads the checkpoint
            del model
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
            model = model.to(device).eval()
        rows = []
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                logits = model(x).logits[0].float()
                gen = model.generate(
                    x,
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    attention_mask=torch.ones_like(x),
                    pad_token_id=0,
                )
            logprobs = torch.log_softmax(logits, -1)
            target = torch.tensor(ids[1:], device=device)
            rows.append(
                {
                    "prompt": ids,
                    "tokens": gen[0, len(ids) :].tolist(),
                    "prompt_logprobs": logprobs[:-1].gather(1, target[:, None])[:, 0].tolist(),
                    "top1": logprobs[:-1].argmax(-1).tolist(),
                }
            )
        answers[dtype] = rows
    out.write_text(json.dumps(answers))


def _pages(model: Path, length: int, hybrid: bool = True) -> int:
    """The KV pages one sequence of `length` tokens may hold in `model`'s engine (a hybrid
    model's pages hold one layer group: `jaxllm.worker.kv_groups`), pages of 16 tokens."""
    from jaxllm.config import CacheConfig
    from jaxllm.loaders import load_config
    from jaxllm.worker.kv_groups import engine_kv_groups
    from jaxllm.worker.kv_sizing import pages_per_sequence

    cache = CacheConfig(disable_hybrid_kv_cache_manager=not hybrid)
    groups = engine_kv_groups(load_config(model), cache, draft=False)
    return pages_per_sequence(groups, length, 16) + 1


def parity(args, work: Path) -> dict:
    model_dir, answers = work / "model", work / "reference.json"
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--reference-into", str(model_dir), "--answers", str(answers)]
    cmd += ["--config", str(args.config), "--parity-layers", str(args.parity_layers)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    subprocess.run(cmd, check=True)
    ref = json.loads(answers.read_text())
    report = {"reference_device": ref["device"], "reference_s": time.perf_counter() - start}
    import jax
    import numpy as np

    from jaxllm import LLM, SamplingParams

    for dtype in args.dtypes:
        precision = "highest" if dtype == "float32" else "default"
        with jax.default_matmul_precision(precision):
            llm = LLM(
                model_dir,
                dtype=dtype,
                max_model_len=max(PROMPT_LENS) + args.max_tokens + 16,
                max_num_seqs=len(PROMPT_LENS),
                attention_backend=args.attention_backend,
                num_pages=len(PROMPT_LENS)
                * _pages(model_dir, max(PROMPT_LENS) + args.max_tokens + 16),
                skip_warmup=True,
            )
            params = SamplingParams(
                temperature=0, max_tokens=args.max_tokens, ignore_eos=True, prompt_logprobs=1
            )
            rows = ref[dtype]
            outs = llm.generate(
                [{"prompt_token_ids": r["prompt"]} for r in rows], params, use_tqdm=False
            )
        matched, first_diffs, lp_err, top1 = 0, [], 0.0, []
        for r, o in zip(rows, outs, strict=True):
            got = o.outputs[0].token_ids
            if got == r["tokens"]:
                matched += 1
            else:
                first_diffs.append(
                    next(
                        i for i, (a, b) in enumerate(zip(got, r["tokens"], strict=False)) if a != b
                    )
                )
            ours = o.prompt_logprobs[1:]
            mine = [d[t].logprob for d, t in zip(ours, r["prompt"][1:], strict=True)]
            lp_err = max(lp_err, float(np.max(np.abs(np.array(mine) - r["prompt_logprobs"]))))
            best = [min(d.items(), key=lambda kv: kv[1].rank)[0] for d in ours]
            top1 += [a == b for a, b in zip(best, r["top1"], strict=True)]
        report[dtype] = {
            "prompts": len(rows),
            "greedy_tokens_matched": matched,
            "first_differing_step": first_diffs,
            "max_prompt_logprob_abs_diff": round(lp_err, 5),
            "prompt_top1_agreement": round(float(np.mean(top1)), 5),
            "matmul_precision": precision,
            "attention_backend": llm.attention_backend,
        }
        print(dtype, json.dumps(report[dtype]), flush=True)
        del llm, outs
        gc.collect()
    return report


def speed(args) -> dict:
    import jax

    from jaxllm import LLM
    from jaxllm.bench.throughput import measure, random_token_prompts

    llm = LLM(
        args.config,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max(args.batches),
        num_pages=max(args.batches)
        * _pages(
            args.config,
            args.input_len + args.output_len + 16,
            hybrid=not args.disable_hybrid_kv_cache_manager,
        ),
        skip_warmup=True,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
    )
    vocab = llm.model_config.vocab_size
    report = {"device": jax.devices()[0].device_kind, "attention_backend": llm.attention_backend}
    for batch in args.batches:
        prompts = random_token_prompts(batch, args.input_len, vocab, SEED + batch)

        def run(n: int, prompts=prompts) -> float:
            return measure(llm, prompts, n, use_tqdm=False)["elapsed_time"]

        compile_s = run(args.output_len)  # compiles what these shapes need
        first, full = min(run(1) for _ in range(2)), min(run(args.output_len) for _ in range(2))
        step_ms = 1e3 * (full - first) / (args.output_len - 1)
        row = {
            "batch": batch,
            "first_run_s": round(compile_s, 2),
            "prefill_plus_one_token_s": round(first, 4),
            "decode_ms_per_step": round(step_ms, 3),
            "decode_tok_s": round(batch * 1e3 / step_ms, 1),
            "output_tok_s": round(batch * args.output_len / full, 1),
        }
        print("speed", json.dumps(row), flush=True)
        report[f"batch_{batch}"] = row
        if args.profile is not None and batch == args.batches[0]:
            with jax.profiler.trace(str(args.profile), create_perfetto_trace=True):
                run(args.output_len)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=Path("benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--parity-layers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--profile", type=Path, help="a JAX profile of the first batch size's run")
    p.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="speed: every layer in one KV cache group (see jaxllm/worker/kv_groups.py)",
    )
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--reference-into", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--answers", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reference_into is not None:
        reference(
            args.reference_into, args.config, args.parity_layers, args.answers, args.max_tokens
        )
        return
    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work:
        if not args.skip_parity:
            report["parity"] = parity(args, Path(work))
    if not args.skip_speed:
        report["speed"] = speed(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
