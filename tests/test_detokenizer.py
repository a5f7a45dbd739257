"""Incremental detokenization equals decoding the whole output; stop strings cut the text."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxllm.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Héllo wörld, naïve café, 日本語, emoji 🙂!",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    prompt, output = ids[:3], ids[3:]
    d = IncrementalDetokenizer(tok, prompt)
    for t in output:
        d.add_token(t)
    assert d.text == tok.decode(output)


def test_random_ids_and_multibyte_characters(tok):
    """Random ids split multi-byte characters across tokens; held-back bytes must not leak."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(3, len(tok), size=30).tolist()
        d = IncrementalDetokenizer(tok, [5])
        for t in ids:
            d.add_token(t)
        full = tok.decode(ids)
        # Before the end, only text for a trailing incomplete character is held back.
        assert full.startswith(d.text)
        d.flush()
        assert d.text == full


def test_stop_strings(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    d = IncrementalDetokenizer(tok, [], stop=["lazy", "fox"])
    stopped_at = None
    for i, t in enumerate(ids):
        if d.add_token(t):
            stopped_at = i
            break
    assert stopped_at is not None
    assert d.text == "The quick brown " and d.stop_reason == "fox"
    d = IncrementalDetokenizer(tok, [], stop=["brown f"], include_stop_str_in_output=True)
    for t in ids:
        if d.add_token(t):
            break
    assert d.text == "The quick brown f"


def test_skip_special_tokens(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("Hi there"), end]
    d = IncrementalDetokenizer(tok, [])
    for t in ids:
        d.add_token(t)
    assert d.text == "Hi there"
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for t in ids:
        d.add_token(t)
    assert d.text == "Hi there<|im_end|>"
