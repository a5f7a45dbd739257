"""Fine-grained FP8 (DeepSeek-V3's format: float8 e4m3 weights, a factor per 128 x 128 block)
on trained weights: the demo model quantized that way here, served as shipped (kept fp8),
against the float model it came from, by `scripts/quant_quality.py`'s perplexity of its
held-out text and greedy agreement, with vLLM's per-channel `fp8` beside them.

    .venv/bin/python benchmarks/fp8_blocks_quality.py --json benchmarks/results/fp8_blocks_quality.json

The demo GGUF is read into a float32 Hugging Face checkpoint by transformers (its GGUF reader),
which `jaxllm.testing.write_fp8_checkpoint` quantizes; the demo's hidden width 576 is 4.5
blocks, so partial blocks are in play. Everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from quant_quality import compare, measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    import transformers

    from jaxllm.model_files import resolve_model
    from jaxllm.testing import write_fp8_checkpoint

    gguf = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        float_dir, fp8_dir = Path(tmp) / "float", Path(tmp) / "fp8"
        kw = dict(gguf_file=gguf.name)
        read = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, dtype=torch.float32, **kw
        )
        # transformers will not save a model it read from GGUF: the same weights, saved plainly
        config = read.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        model.save_pretrained(float_dir, safe_serialization=True)
        transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(float_dir)
        write_fp8_checkpoint(float_dir, fp8_dir, args.block)
        rows = compare(
            [
                measure(str(float_dir), "float"),
                measure(str(fp8_dir), ""),  # kept as shipped
                measure(str(float_dir), "fp8"),  # per output channel
            ]
        )
    names = ["float32", f"fp8 blocks {args.block[0]}x{args.block[1]}", "fp8 per channel"]
    print(f"{'weights':>22} {'ppl':>8} {'ratio':>6} {'bytes ratio':>11}  divergence")
    for name, r in zip(names, rows, strict=True):
        r["weights"] = name
        print(
            f"{name:>22} {r['perplexity']:8.3f} {r['perplexity_ratio']:6.3f} "
            f"{r['weight_bytes_ratio']:11.3f}  {r['first_divergence']}"
        )
    if args.json:
        import jax

        for r in rows:
            del r["greedy_tokens"]
        out = {"device": jax.devices()[0].device_kind, "model": args.model, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
