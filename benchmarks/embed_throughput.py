"""Embeddings per second of all-MiniLM-L6-v2 on this CPU: jaxllm's `LLM.embed` against
sentence-transformers' `SentenceTransformer.encode` (torch), from the same texts, in one run.

    .venv/bin/python benchmarks/embed_throughput.py [--model all-minilm-l6-v2]

Short sentences (6 to 25 words). At each batch size the sentences go in calls of that size,
each side end to end: tokenizing, the model, pooling as the checkpoint says (mean over the
tokens, L2-normalized), vectors back as numpy (sentence-transformers sorts a call's sentences by
length and pads each batch to its longest; jaxllm packs them into its bucketed programs). The
figure is the median of `--repeats` passes over all sentences; torch uses as many threads as
this machine has cores. The ratio is jaxllm's rate over sentence-transformers', and the cosine
is the smallest between the two sides' vectors. `--max-num-batched-tokens` is the encoder's
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

    import sentence_transformers
    import torch

    from jaxllm import LLM
    from jaxllm.bench import write_json
    from jaxllm.model_files import resolve_model

    args.model = str(resolve_model(args.model))
    torch.set_num_threads(os.cpu_count() or 1)
    texts = sentences(args.num_sentences)
    llm = LLM(
        args.model,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    compiled = llm.runner.num_compilations
    max_len = max(len(llm.tokenizer(t)["input_ids"]) for t in texts)
    ref = sentence_transformers.SentenceTransformer(args.model, device="cpu")

    def ours(batch: list[str]) -> np.ndarray:
        return np.asarray([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])

    def theirs(batch: list[str]) -> np.ndarray:
        return ref.encode(batch, batch_size=len(batch), convert_to_numpy=True)

    rows = []
    for size in args.batch_sizes:
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        timing = {}
        vectors = {}
        for name, fn in (("jaxllm", ours), ("sentence_transformers", theirs)):
            fn(batches[0])  # first-call costs out of the timing
            passes = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = [fn(b) for b in batches]
                passes.append(time.perf_counter() - start)
            vectors[name] = np.concatenate(out)
            timing[name] = len(texts) / statistics.median(passes)
        peer = vectors["sentence_transformers"]
        cosine = float(np.min(np.sum(vectors["jaxllm"] * peer, axis=1)))
        row = {
            "batch_size": size,
            "jaxllm_per_s": round(timing["jaxllm"], 1),
            "sentence_transformers_per_s": round(timing["sentence_transformers"], 1),
            "ratio": round(timing["jaxllm"] / timing["sentence_transformers"], 2),
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
            "num_sentences": len(texts),
            "longest_tokens": max_len,
            "torch": torch.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "warmup_seconds": round(llm.warmup_seconds, 1),
            "num_programs": llm.runner.num_programs,
            "compilations_after_warmup": llm.runner.num_compilations - compiled,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
