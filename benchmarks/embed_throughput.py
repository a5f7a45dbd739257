"""Embeddings per second of an encoder (all-MiniLM-L6-v2) on this CPU: jaxllm's `EncoderRunner`
against the same model in transformers on torch, pooled as sentence-transformers pools it (mean
over the tokens, L2-normalized), in one run.

    .venv/bin/python benchmarks/embed_throughput.py [--model all-minilm-l6-v2]

Short sentences (6 to 25 words), tokenized once by the model's tokenizer; both sides get the same
token ids. At each batch size the sentences run in batches of that size (torch pads each batch
to its longest sentence, as sentence-transformers does; jaxllm packs them into its bucketed
programs); the figure is the median of `--repeats` passes over all sentences. torch uses as many
threads as this machine has cores. The ratio is jaxllm's rate over torch's, and the cosine is
the smallest between the two sides' vectors. `--max-num-batched-tokens` is the runner's
budget of token slots a batch (1,024 by default, its own default: 8,192 halved the rate at
batch 256 here).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

WORDS = (
    "the a model server token fast small quiet river mountain city data learning vector "
    "search query document answer question engine cache page batch light green blue runs "
    "reads writes finds sends keeps over under near with without before after"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=rng.integers(6, 26))).capitalize() + "." for _ in range(n)
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="all-minilm-l6-v2", help="a model directory or demo name")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 32, 256])
    p.add_argument("--num-sentences", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--json", default="benchmarks/results/embed-throughput-cpu.json")
    args = p.parse_args()

    import jax.numpy as jnp
    import torch
    import transformers

    from jaxllm.bench import write_json
    from jaxllm.loaders.encoder import load_encoder
    from jaxllm.model_cache import resolve_model
    from jaxllm.pooling import read_pooler_config
    from jaxllm.worker import EncoderRunner

    args.model = str(resolve_model(args.model))
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    texts = sentences(args.num_sentences)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    max_len = max(len(x) for x in ids)

    runner = EncoderRunner(
        load_encoder(args.model, dtype=jnp.float32),
        read_pooler_config(args.model),
        max_model_len=256,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    warmup = runner.warmup()
    ref = transformers.AutoModel.from_pretrained(args.model, dtype=torch.float32).eval()

    def ours(batch: list[list[int]]) -> np.ndarray:
        return runner.run(batch)

    def theirs(batch: list[list[int]]) -> np.ndarray:
        width = max(len(x) for x in batch)
        tok = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, x in enumerate(batch):
            tok[r, : len(x)] = torch.tensor(x)
            mask[r, : len(x)] = 1
        with torch.inference_mode():
            h = ref(input_ids=tok, attention_mask=mask).last_hidden_state
        m = mask[..., None].float()
        v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(v, dim=-1).numpy()

    rows = []
    for size in args.batch_sizes:
        batches = [ids[i : i + size] for i in range(0, len(ids), size)]
        timing = {}
        vectors = {}
        for name, fn in (("jaxllm", ours), ("torch", theirs)):
            fn(batches[0])  # first-call costs out of the timing
            passes = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = [fn(b) for b in batches]
                passes.append(time.perf_counter() - start)
            vectors[name] = np.concatenate(out)
            timing[name] = len(ids) / statistics.median(passes)
        cosine = float(np.min(np.sum(vectors["jaxllm"] * vectors["torch"], axis=1)))
        row = {
            "batch_size": size,
            "jaxllm_per_s": round(timing["jaxllm"], 1),
            "torch_per_s": round(timing["torch"], 1),
            "ratio": round(timing["jaxllm"] / timing["torch"], 2),
            "min_cosine": cosine,
        }
        rows.append(row)
        print(row)
    write_json(
        args.json,
        {
            "benchmark": "embed_throughput",
            "model": os.path.basename(os.path.normpath(args.model)),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "num_sentences": len(ids),
            "longest_tokens": max_len,
            "torch": torch.__version__,
            "warmup_seconds": round(warmup, 1),
            "num_programs": runner.num_programs,
            "compilations_after_warmup": runner.num_compilations - runner.compilations_at_warmup,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
