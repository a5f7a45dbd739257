"""A hybrid linear-attention model on this machine: decode throughput at batch 1 and 32, and the
time to first token of a returning conversation (from a saved state, and recomputed), beside
a pure-attention model of the same width and depth, in one run.

    .venv/bin/python benchmarks/hybrid_decode.py [--layers 8] [--hidden 512] [--json PATH]

Both models are random, written by transformers (torch needed, as for the tests): a Qwen3.5
(three Gated DeltaNet layers to one gated attention layer) and a Qwen3 with the same hidden
size, layers, heads, MLP and vocabulary. The hybrid runs twice: with its prefix cache's saved
states (`mamba_cache_mode` align, the default) and without (none: prefixes recomputed). Per
model:

    decode_tok_s[b]   output tokens per second of b requests decoding 64 tokens each after
                      a 64-token prompt (greedy, ignore_eos), after a warm-up run
    ttft_first_ms     a 1,024-token conversation's first token, served cold (it answers 16
                      tokens)
    ttft_return_ms    the conversation back with its answer and 16 new tokens: the first
                      token, its prefix served from the prefix cache up to the last full page
                      computed (token 1,024; the hybrid's linear layers from the state saved
                      there) or recomputed
    hit_tokens        the returning conversation's tokens served from the cache
    state_bytes_per_request, kv_bytes_per_token   the memory each keeps

Every figure is the median of 3 runs on this machine; run both models in one invocation so
that they see the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.models.linear_attention import state_bytes_per_slot

VOCAB = 4096


def write_models(root: Path, layers: int, hidden: int) -> dict[str, Path]:
    import torch
    import transformers

    from jaxllm.testing import write_tiny_tokenizer

    heads = hidden // 64
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    hybrid = dict(
        linear_num_key_heads=heads // 2,
        linear_num_value_heads=heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
    )
    paths = {}
    for name, config, model in (
        (
            "qwen3.5 (hybrid)",
            transformers.Qwen3_5TextConfig(**common, **hybrid),
            "Qwen3_5ForCausalLM",
        ),
        ("qwen3 (attention)", transformers.Qwen3Config(**common), "Qwen3ForCausalLM"),
    ):
        torch.manual_seed(0)
        path = root / model
        getattr(transformers, model)(config).save_pretrained(path)
        write_tiny_tokenizer(path, vocab_size=VOCAB)
        paths[name] = path
    return paths


def _median_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(path: Path, batches: list[int], **engine) -> dict:
    llm = LLM(path, dtype="float32", max_num_seqs=max(batches), max_model_len=2048, **engine)
    rng = np.random.default_rng(0)
    decode = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out: dict = {"decode_tok_s": {}}
    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, 64).tolist()} for _ in range(b)]
        llm.generate(prompts, decode, use_tqdm=False)  # warm-up
        seconds = _median_seconds(lambda p=prompts: llm.generate(p, decode, use_tqdm=False))
        out["decode_tok_s"][b] = b * 64 / seconds
    one = SamplingParams(temperature=0, max_tokens=1)
    answer = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    conversation = rng.integers(3, VOCAB, 1024).tolist()
    first, returning, hits = [], [], []
    kv = llm.kv_cache_manager
    for i in range(3):  # a new conversation each time, so that the first run is cold
        conv = [(t + i) % (VOCAB - 3) + 3 for t in conversation]
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": conv}, one, use_tqdm=False)
        first.append(time.perf_counter() - start)
        said = llm.generate({"prompt_token_ids": conv}, answer, use_tqdm=False)
        more = conv + list(said[0].outputs[0].token_ids) + rng.integers(3, VOCAB, 16).tolist()
        before = kv.prefix_cache_hits
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": more}, one, use_tqdm=False)
        returning.append(time.perf_counter() - start)
        hits.append(kv.prefix_cache_hits - before)
    out["ttft_first_ms"] = 1e3 * statistics.median(first)
    out["ttft_return_ms"] = 1e3 * statistics.median(returning)
    out["hit_tokens"] = statistics.median(hits)
    out["prefix_caching"] = llm.config.cache.enable_prefix_caching
    config = llm.runner.config
    linear = config.linear_attention is not None
    out["state_bytes_per_request"] = state_bytes_per_slot(config, np.float32) if linear else 0
    kv = llm.runner.device.cache.kv
    tokens = llm.config.cache.num_pages * llm.config.cache.page_size
    out["kv_bytes_per_token"] = sum(a.nbytes for a in jax.tree.leaves(kv)) // tokens
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(Path(tmp), args.layers, args.hidden)
        hybrid, attention = paths.values()
        runs = {
            "qwen3.5 (hybrid, saved states)": (hybrid, {}),
            "qwen3.5 (hybrid, recompute)": (hybrid, {"mamba_cache_mode": "none"}),
            "qwen3 (attention)": (attention, {}),
        }
        results = {name: measure(path, args.batches, **kw) for name, (path, kw) in runs.items()}
    head = " ".join(f"b={b} tok/s".rjust(12) for b in args.batches)
    print(
        f"{'model':<31} {head}  TTFT cold ms  TTFT return ms  hit tokens  state B/req  KV B/token"
    )
    for name, r in results.items():
        cells = " ".join(f"{r['decode_tok_s'][b]:12.1f}" for b in args.batches)
        print(
            f"{name:<31} {cells}  {r['ttft_first_ms']:12.1f}  {r['ttft_return_ms']:14.1f}"
            f"  {r['hit_tokens']:>10}  {r['state_bytes_per_request']:>11,}"
            f"  {r['kv_bytes_per_token']:>10,}"
        )
    data = {"layers": args.layers, "hidden": args.hidden, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
