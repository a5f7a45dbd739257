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


def _stream(tok, ids: list[int], params, finish_at: int | None = None):
    """Feeds `ids` one update at a time through an OutputProcessor, as the engine core would
    (the last one finishing by length); returns the texts of the snapshots and the final."""
    from jaxllm.engine.core_outputs import FinishReason, RequestUpdate
    from jaxllm.engine.output_processor import OutputProcessor

    proc = OutputProcessor(tok)
    proc.add_request("r", 0, [5, 6], params)
    snapshots = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        finished, _ = proc.process(
            [RequestUpdate("r", [t], finish_reason=FinishReason.LENGTH if last else None)]
        )
        snapshots.append(proc.output("r"))
        if finished:
            break
    return [s.text for s in snapshots], snapshots[-1]


def test_a_stream_never_sends_text_a_stop_string_takes_back(tok):
    """Issue 13, defect 3: the start of a stop string must not be streamed before it is known
    whether the rest follows (vLLM holds back the longest stop string minus one character)."""
    from jaxllm import SamplingParams

    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    # A stop string that starts inside one token's text and ends in a later one's.
    k = next(i for i in range(1, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 3)
    start = len(pieces[k]) - 2
    stop = text[start : len(pieces[k + 1]) + 1]
    texts, final = _stream(tok, ids, SamplingParams(stop=[stop], max_tokens=None))
    assert final.finish_reason == "stop" and final.text == text[:start]
    for snapshot in texts:
        assert final.text.startswith(snapshot), (snapshot, final.text)
    # Nothing is held back once the output is finished, or when the stop string stays in.
    texts, final = _stream(tok, ids, SamplingParams(stop=["zzz"], max_tokens=None))
    assert final.text == text and texts[-1] == text
    texts, final = _stream(
        tok, ids, SamplingParams(stop=[stop], include_stop_str_in_output=True, max_tokens=None)
    )
    assert texts[k] == pieces[k]


def test_stop_strings_wait_for_min_tokens(tok):
    """Issue 13, defect 4: like EOS and stop ids, a stop string ends the output only once
    min_tokens tokens are out (vLLM's rule)."""
    from jaxllm import SamplingParams

    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    early = tok.decode(ids[:2])[-3:]  # completed by the second token
    _, final = _stream(tok, ids, SamplingParams(stop=[early], max_tokens=None))
    assert final.finish_reason == "stop" and len(final.token_ids) == 2
    _, final = _stream(tok, ids, SamplingParams(stop=[early], min_tokens=3, max_tokens=None))
    assert final.finish_reason == "length" and final.text == text
    _, final = _stream(tok, ids, SamplingParams(stop=["lazy"], min_tokens=3, max_tokens=None))
    assert final.finish_reason == "stop" and final.text == text[: text.index("lazy")]


def test_a_snapshot_does_not_change_as_the_request_goes_on(tok):
    """Found by benchmarks/soak.py: a snapshot shared its logprobs list with the live request,
    so a stream read late saw more logprob entries than token ids (a 500 mid-stream)."""
    from jaxllm import SamplingParams
    from jaxllm.engine.core_outputs import RequestUpdate, TokenLogprobs
    from jaxllm.engine.output_processor import OutputProcessor

    proc = OutputProcessor(tok)
    proc.add_request("r", 0, [5, 6], SamplingParams(logprobs=1, max_tokens=None))
    first = None
    for t in tok.encode("The quick brown fox")[:3]:
        proc.process([RequestUpdate("r", [t], [TokenLogprobs(-0.5, 1, [t], [-0.5])])])
        first = first or proc.output("r")
    assert len(first.token_ids) == len(first.logprobs) == 1
    assert len(proc.output("r").logprobs) == 3
