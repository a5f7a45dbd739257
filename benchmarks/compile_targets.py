"""`jaxllm compile` over the models and targets of benchmarks/results/compile-targets.md.

Each run compiles (with the target's real compiler, here on the CPU) the engine `serve` would
build on that target from the model's config.json (benchmarks/configs/), and its report goes to
benchmarks/results/compile/<model>-<target>[-<variant>].json. Then the table is rewritten from
every report there. Every speed figure in it is a prediction from the compiler's cost analysis,
labelled so.

    .venv-compile/bin/python benchmarks/compile_targets.py                 # every run
    .venv-compile/bin/python benchmarks/compile_targets.py --only 8b-v6e-1 --programs decode
    .venv-compile/bin/python benchmarks/compile_targets.py --table         # the table alone

Runs that do not fit are recorded as refusals (the refusal is the result).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
OUT = ROOT / "benchmarks" / "results" / "compile"

# name: (model config dir, target, engine flags)
RUNS = {
    "smollm2-v5e-1": ("smollm2-135m", "v5e-1", {"num_pages": 1024}),
    "8b-v6e-1": ("llama-3.1-8b", "v6e-1", {}),
    "8b-v5e-4": ("llama-3.1-8b", "v5e-4", {}),
    "8b-h100": ("llama-3.1-8b", "h100", {}),
    "70b-v5e-8-int8": ("llama-3.1-70b", "v5e-8", {"quantization": "int8"}),
    "qwen3-30b-a3b-v6e-4": ("qwen3-30b-a3b", "v6e-4", {}),
    "gemma3-27b-v6e-4": ("gemma-3-27b", "v6e-4", {}),
    "8b-v5e-1-int8": ("llama-3.1-8b", "v5e-1", {"quantization": "int8"}),
    "8b-h200": ("llama-3.1-8b", "h200", {}),
    "70b-v5e-8": ("llama-3.1-70b", "v5e-8", {}),
    "70b-v6e-8": ("llama-3.1-70b", "v6e-8", {}),
    "8b-v5e-8": ("llama-3.1-8b", "v5e-8", {}),
    "llava-7b-v6e-1": ("llava-1.5-7b", "v6e-1", {}),
    "llava-7b-h100": ("llava-1.5-7b", "h100", {}),
    # The hub's image processor bound (12,845,056 pixels: 16,384 tokens an image).
    "qwen2.5-vl-7b-v6e-1": ("qwen2.5-vl-7b", "v6e-1", {}),
    # A hybrid: 48 Gated DeltaNet layers (a recurrent state per request) and 16 attention ones.
    "qwen3.5-27b-h100": ("qwen3.5-27b", "h100", {}),
    "qwen3.5-27b-v6e-4": ("qwen3.5-27b", "v6e-4", {}),
    # gpt-oss: sinks, sliding and full layers, 32 / 128 experts (MXFP4 as shipped, kept 4-bit
    # on the device: gpt-oss-120b fits one H100, as vLLM serves it).
    "gpt-oss-20b-h100": ("gpt-oss-20b", "h100", {}),
    "gpt-oss-20b-v6e-4": ("gpt-oss-20b", "v6e-4", {}),
    "gpt-oss-120b-h200": ("gpt-oss-120b", "h200", {}),
    "gpt-oss-120b-h100": ("gpt-oss-120b", "h100", {}),
    "gpt-oss-120b-v6e-8": ("gpt-oss-120b", "v6e-8", {}),
    # Llama 4 Scout as text: chunked attention, 16 experts with a shared one in every layer.
    "llama-4-scout-v6e-8": ("llama-4-scout", "v6e-8", {}),
    "llama-4-scout-h200": ("llama-4-scout", "h200", {}),
    # Gemma 4 as text: sliding layers of 16 (31B) or 8 (26B-A4B) kv heads of 256 beside full
    # layers of 4 or 2 of 512, packed into one cache row shape; the 26B-A4B's 128 experts
    # beside every dense MLP (over 4 chips its full layers' 2 kv heads are repeated twice).
    "gemma-4-31b-v6e-4": ("gemma-4-31b", "v6e-4", {}),
    "gemma-4-31b-h200": ("gemma-4-31b", "h200", {}),
    "gemma-4-26b-a4b-v6e-4": ("gemma-4-26b-a4b", "v6e-4", {}),
    "gemma-4-26b-a4b-h100": ("gemma-4-26b-a4b", "h100", {}),
    # DeepSeek's latent attention: one 576-wide row per token and layer in the cache (640
    # lanes on a TPU), whatever the heads; V2-Lite's 64 experts (6 routed + 2 shared), V3's
    # 256 in groups (8 routed + 1 shared) as its FP8 checkpoint ships them.
    "deepseek-v2-lite-h100": ("deepseek-v2-lite", "h100", {}),
    "deepseek-v2-lite-v6e-4": ("deepseek-v2-lite", "v6e-4", {}),
    "deepseek-v3-h200x8": ("deepseek-v3", "h200x8", {}),
    "deepseek-v3-v5p-16": ("deepseek-v3", "v5p-16", {}),
}

# Published figures of the TPU peers for the same model and chip (their measurements).
PEERS = {
    "8b-v5e-8": "JetStream: Llama-3-8B on v5e-8, batch 128, 1024 in / 1024 out: about 8,200 "
    "output tok/s in bf16 (about 10,900 in int8)",
    "8b-v6e-1": "sglang-jax: Llama-3.1-8B on v6e-4 (not 1), 512 in / 512 out at concurrency 16: "
    "1,449 output tok/s, TPOT 9.9 ms",
}


def run(name: str, programs: str, context: int) -> dict:
    from jaxllm.aot import engine, report, targets
    from jaxllm.config import EngineConfig

    model, target, flags = RUNS[name]
    config = EngineConfig.create(CONFIGS / model, **flags)
    start = time.perf_counter()
    try:
        compiled = engine.compile_engine(
            config, targets.parse_target(target), progress=True, decode_only=programs == "decode"
        )
    except engine.DoesNotFit as e:
        return {"run": name, "model": model, "target": target, "flags": flags, "refused": str(e)}
    data = report.summary(compiled, context=context)
    data |= {"run": name, "flags": flags, "programs_compiled": programs}
    data["wall_seconds"] = time.perf_counter() - start
    print(report.render(data))
    return data


def table() -> str:
    # A report `jaxllm compile --json` wrote by hand is named by its file.
    rows = [{"run": f.stem} | json.loads(f.read_text()) for f in sorted(OUT.glob("*.json"))]
    lines = [
        "| run | fits | weights / KV per device | max_model_len | programs, compile | "
        "decode b=1 (PREDICTED) | decode b=64 (PREDICTED) | KV copies |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in rows:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.get("flags", {}).items())
        name = f"{d['run']} ({d['target']}{', ' + flags if flags else ''})"
        if "refused" in d:
            lines.append(f"| {name} | refused: {d['refused']} | | | | | | |")
            continue
        m = d["memory_per_device"]
        pred = {r["batch"]: r for r in d["decode_prediction"]["rows"]}

        def cell(b, pred=pred):
            r = pred.get(b) or pred[max(pred)]
            return (
                f"{r['tokens_per_s']:,.0f} tok/s at {r['context']:,} ctx (b={r['batch']}), "
                f"{r['share']:.0%} of roofline {r['roofline_tokens_per_s']:,.0f}"
            )

        lines.append(
            f"| {name} | {'yes' if m['fits'] else 'NO'} | {m['weight_device_bytes'] / 2**30:.1f}"
            f" / {m['kv_cache_bytes'] / 2**30:.1f} GiB ({m['kv_cache_tokens']:,} tokens) | "
            f"{d['max_model_len']:,} | {d['num_programs']} ({d.get('programs_compiled', 'all')}), "
            f"{d['compile_seconds']:,.0f} s | {cell(1)} | {cell(64)} | "
            f"{len(d['kv_cache_copies'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=list(RUNS), default=None)
    p.add_argument("--programs", choices=("all", "decode"), default="all")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--table", action="store_true", help="only rewrite the table")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.table:
        for name in args.only or list(RUNS):
            data = run(name, args.programs, args.context)
            if name in PEERS:
                data["peer"] = PEERS[name]
            (OUT / f"{name}.json").write_text(json.dumps(data, indent=1))
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
