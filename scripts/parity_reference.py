"""Greedy reference outputs from Hugging Face transformers (torch, float32) for the demo model.

The parity test calls `hf_greedy` directly when torch is installed; otherwise it reads the
fixture this script writes:

    .venv/bin/python scripts/parity_reference.py   # -> tests/fixtures/smollm2_greedy.json

transformers loads the same GGUF file and dequantizes it itself, so both sides start from the
same weights. The loop records, at every step, the gap between the top two logits, so a
divergence can be told apart from a near-tie.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_greedy.json"
MAX_NEW_TOKENS = 64

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about the ocean.",
    "Explain what a neural network is in two sentences.",
    "List three fruits that are red.",
]


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """The 8 parity prompts as token ids: 4 plain, 4 through the chat template."""
    ids = [tokenizer.encode(p) for p in PLAIN_PROMPTS]
    for p in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def hf_greedy(gguf_path: Path, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS):
    """Returns (tokens, gaps): per prompt, the greedy token ids and top-1/top-2 logit gaps."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    all_tokens, all_gaps = [], []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens, gaps = [], []
            for _ in range(max_new_tokens):
                logits = out.logits[0, -1]
                top2 = torch.topk(logits, 2).values
                token = int(torch.argmax(logits))
                tokens.append(token)
                gaps.append(float(top2[0] - top2[1]))
                out = model(
                    torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
                )
            all_tokens.append(tokens)
            all_gaps.append(gaps)
    return all_tokens, all_gaps


def main() -> int:
    from jaxllm.loaders.gguf import load_gguf_tokenizer
    from jaxllm.model_cache import cache_dir, fetch_demo_model

    path = fetch_demo_model("smollm2-135m")
    prompts = prompt_token_ids(load_gguf_tokenizer(path, cache_dir()))
    tokens, gaps = hf_greedy(path, prompts)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(
        json.dumps({"prompt_token_ids": prompts, "tokens": tokens, "gaps": gaps}, indent=None)
    )
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
