"""The serving benchmark's workload (`jaxllm bench serve`, `jaxllm/bench/serve.py`): the
requests it sends and when it sends them.

Datasets: `random` (the default) makes prompts of --random-input-len random common English
words (about one token each for common tokenizers; the exact count is the server's
`prompt_tokens`), or, with --tokenizer, of that many random token ids of the tokenizer's
vocabulary, as vLLM does; --random-range-ratio draws each request's input and output lengths
uniformly within that ratio of them. `custom` reads --dataset-path: a `.jsonl` file of
{"prompt": ...} objects, or any other file with one prompt per line, cycled to --num-prompts.
No dataset is downloaded. The requests' send times: `arrival_offsets`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass

import numpy as np

# Common short English words; most BPE vocabularies hold " word" as one token.
WORDS = (
    "the of and to in is was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time "
    "has look two more write go see number no way could people my than first water been call "
    "who oil its now find long down day did get come made may part over new sound take only "
    "little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any "
    "same tell boy follow came want show also around form three small set put end does another "
    "well large must big even such because turn here why ask went men read need land different "
    "home us move try kind hand picture again change off play spell air away animal house point "
    "page letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye "
    "light thought head under story saw left few while along might close something seem next "
    "hard open example begin life always those both paper together got group often run important"
).split()


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens with --tokenizer, else words: counted when the server sends no usage
    output_len: int  # max_tokens


def load_tokenizer(name: str):
    from jaxllm.loaders import load_tokenizer

    return load_tokenizer(name)[0]


def _lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> list[int]:
    if ratio == 0:
        return [length] * n
    low, high = max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))
    return rng.integers(low, high + 1, size=n).tolist()


def _token_prompt(tokenizer, allowed: list[int], rng: random.Random, n: int) -> tuple[str, int]:
    """About n random tokens of the vocabulary, as text of at most n tokens. Decoding and
    encoding again can merge or split tokens (bytes of no whole character decode to U+FFFD,
    three bytes), so ids are dropped from the end until the text encodes to n or fewer."""
    ids = tokenizer.encode(tokenizer.decode(rng.choices(allowed, k=n)), add_special_tokens=False)
    ids = ids[:n]
    while True:
        text = tokenizer.decode(ids)
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        if num_tokens <= n:
            return text, num_tokens
        ids = ids[: len(ids) - (num_tokens - n)]


def count_tokens(text: str, tokenizer) -> int:
    """The tokens of `text` with `tokenizer`, else its words."""
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else len(text.split())


def make_requests(args: argparse.Namespace, tokenizer=None) -> list[SampleRequest]:
    n = args.num_prompts
    lens_rng = np.random.default_rng(args.seed)
    in_lens = _lengths(lens_rng, n, args.random_input_len, args.random_range_ratio)
    out_lens = _lengths(lens_rng, n, args.random_output_len, args.random_range_ratio)
    if args.dataset_name == "custom":
        with open(args.dataset_path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        lines = [line for line in lines if line]
        if args.dataset_path.endswith(".jsonl"):
            lines = [json.loads(line)["prompt"] for line in lines]
        if not lines:
            raise ValueError(f"{args.dataset_path}: no prompts")
        prompts = [lines[i % len(lines)] for i in range(n)]
        return [
            SampleRequest(p, count_tokens(p, tokenizer), out)
            for p, out in zip(prompts, out_lens, strict=True)
        ]
    rng = random.Random(args.seed)
    if tokenizer is None:
        prompts = [" ".join(rng.choices(WORDS, k=k)) for k in in_lens]
        return [SampleRequest(p, k, o) for p, k, o in zip(prompts, in_lens, out_lens, strict=True)]
    special = set(tokenizer.all_special_ids)
    allowed = [i for i in range(len(tokenizer)) if i not in special]
    return [
        SampleRequest(*_token_prompt(tokenizer, allowed, rng, k), o)
        for k, o in zip(in_lens, out_lens, strict=True)
    ]


def arrival_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma-distributed gaps of
    shape `burstiness` and mean 1/rate (exponential, a Poisson process, at burstiness 1); all
    zero when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
