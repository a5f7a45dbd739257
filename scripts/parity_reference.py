"""Greedy reference outputs from Hugging Face transformers (torch, float32) for the demo models.

The parity test calls `hf_greedy` directly when torch is installed; otherwise it reads the
fixture this script writes per demo model:

    .venv/bin/python scripts/parity_reference.py              # every demo model
    .venv/bin/python scripts/parity_reference.py gemma3-270m  # -> tests/fixtures/gemma3_greedy.json

transformers loads the same GGUF file and dequantizes it itself, so both sides start from the
same weights. The loop records, at every step, the gap between the top two logits, so a
divergence can be told apart from a near-tie.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

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
# Past Gemma 3's 512-token window: a text of about 700 tokens, then a question about it.
LONG_PROMPT = (
    " ".join(
        f"Day {i}: the lighthouse keeper wrote that the sea was calm, the lamp was lit at dusk, "
        f"and {i % 5 + 2} ships passed the northern rocks before midnight."
        for i in range(1, 26)
    )
    + "\nQuestion: on which day did the keeper first mention the lamp? Answer:"
)


@dataclasses.dataclass(frozen=True)
class Demo:
    max_new_tokens: int
    plain: tuple[str, ...]
    chat: tuple[str, ...]
    # A divergence is allowed only where transformers' top-1/top-2 logit gap is below this
    # (different but equally valid summation orders can flip a near-tie).
    tie_gap: float = 0.0

    def fixture(self, name: str) -> Path:
        return FIXTURES / f"{name.split('-')[0]}_greedy.json"


DEMOS = {
    "smollm2-135m": Demo(64, tuple(PLAIN_PROMPTS), tuple(CHAT_PROMPTS)),
    "gemma3-270m": Demo(
        48, (*PLAIN_PROMPTS[:3], LONG_PROMPT), tuple(CHAT_PROMPTS[:3]), tie_gap=0.02
    ),
}


def prompt_token_ids(tokenizer, demo: Demo) -> list[list[int]]:
    """The demo's parity prompts as token ids: the plain ones, then the chat-templated ones."""
    ids = [tokenizer.encode(p) for p in demo.plain]
    for p in demo.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def hf_greedy(gguf_path: Path, prompts: list[list[int]], max_new_tokens: int):
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


def main(argv: list[str]) -> int:
    from jaxllm.loaders.gguf import load_gguf_tokenizer
    from jaxllm.model_files import cache_dir, fetch_demo_model

    for name in argv or list(DEMOS):
        demo = DEMOS[name]
        path = fetch_demo_model(name)
        prompts = prompt_token_ids(load_gguf_tokenizer(path, cache_dir()), demo)
        tokens, gaps = hf_greedy(path, prompts, demo.max_new_tokens)
        fixture = demo.fixture(name)
        fixture.parent.mkdir(parents=True, exist_ok=True)
        fixture.write_text(
            json.dumps({"prompt_token_ids": prompts, "tokens": tokens, "gaps": gaps})
        )
        print(f"wrote {fixture}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
