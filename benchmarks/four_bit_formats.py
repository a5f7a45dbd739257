"""The two 4-bit weight formats on the demo model, quality only: every linear layer (and the
tied head) round-tripped through int4 as the engine holds it (groups of 32 with a float16 scale
and offset, the head's first rows int8: `quantization.quantize_head`), or through MXFP4 (E2M1
values with a power-of-two scale per 32, as gpt-oss ships its experts: `loaders/mxfp4.py`),
the model then run in float32. Perplexity against float on the first 1,200 tokens of texts of
different kinds: the held-out text of `scripts/quant_quality.py` and, where the machine has
them, a licence, Python source and two shell manuals (nothing was tuned on the last four).

    .venv/bin/python benchmarks/four_bit_formats.py --json benchmarks/results/four_bit_formats.json

The engine serves MXFP4 only for a mixture of experts' weights (gpt-oss); here it is applied
to a dense model's layers to compare the formats themselves.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 1200


def texts() -> dict[str, str]:
    import argparse as argparse_module

    out = {"held-out": (ROOT / "tests" / "fixtures" / "heldout_python_docs.txt").read_text()}
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.exists():
        out["gpl-3"] = gpl.read_text()[:11000]
    out["argparse.py"] = Path(argparse_module.__file__).read_text()[20000:30000]
    for name in ("INTRO", "POSIX"):
        doc = Path(f"/usr/share/doc/bash/{name}.gz")
        if doc.exists():
            out[f"bash-{name}"] = gzip.decompress(doc.read_bytes()).decode()[:10000]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, str(ROOT / "tests"))
    from jaxllm import quantization as q
    from jaxllm.loaders import load_model, mxfp4

    from helpers import prefill_logits

    loaded = load_model("smollm2-135m", dtype=jnp.float32, quantization="float")
    model, config = loaded.model, loaded.config
    tokenizer = loaded.tokenizer
    ids = {name: tokenizer(text)["input_ids"][:TOKENS] for name, text in texts().items()}
    gamma = np.abs(np.asarray(model.norm.weight.get_value()) + config.norm_offset)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    paths = [p for p in flat if p[-1] in q.QUANTIZABLE]
    weights = {p: np.asarray(flat[p].get_value()) for p in paths}

    def perplexities() -> dict[str, float]:
        out = {}
        for name, tokens in ids.items():
            logits = prefill_logits(model, config, tokens)[:-1]
            logits = logits - logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            out[name] = math.exp(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean())
        return out

    def round_trip(fmt: str) -> None:
        for p in paths:
            head = p[-1] == "embed_tokens"  # [V, D]; the others are [in, out]
            w = weights[p] if head else weights[p].T
            if fmt == "int4":
                importance = gamma**q.HEAD_IMPORTANCE_POWER
                back = q.dequantize_np(
                    q.quantize_head(w, importance) if head else q.quantize(w, "int4")
                )
            else:
                back = mxfp4.dequantize(*mxfp4.quantize(w))
            flat[p].set_value(jnp.asarray(back if head else back.T))
        nnx.update(model, nnx.from_flat_state(list(flat.items())))

    rows = {"float": perplexities()}
    for fmt in ("int4", "mxfp4"):
        round_trip(fmt)
        rows[fmt] = perplexities()
    print(f"{'format':>8} " + " ".join(f"{n:>12}" for n in ids))
    for fmt, ppl in rows.items():
        ratios = " ".join(f"{ppl[n] / rows['float'][n]:12.3f}" for n in ids)
        print(f"{fmt:>8} {ratios}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"tokens_per_text": TOKENS, "perplexity": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
