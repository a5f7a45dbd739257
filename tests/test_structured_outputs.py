"""Structured outputs in the engine: JSON schema, regex, choice and grammar constraints, applied
on the device from a host-filled bitmask, with n > 1, preemption and speculative decoding.

A random tiny model samples almost any token, so its outputs test the masks hard: whatever it
generates must still match. The demo model through the server (the OpenAI client's
`parse`, generated schemas, tool calls) is in test_server_structured.py."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.structured_outputs import StructuredOutputsParams
from jaxllm.worker.sampler import sample

ENGINE = dict(max_model_len=256, num_pages=128, max_num_seqs=16, max_num_batched_tokens=128)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                                                                   "minimum": 0, "maximum": 4}},
            "required": ["kind"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"[0-9]{3}-[a-z]{2,4}(\.[A-Z])?"
CHOICE = ["yes", "no", "maybe so"]
GRAMMAR = 'start: "x=" NUM (", " NUM)*\nNUM: /[1-9][0-9]?/'  # Lark
GRAMMAR_RE = r"x=[1-9][0-9]?(, [1-9][0-9]?)*"
CONSTRAINTS = [
    {"json": SCHEMA, "disable_any_whitespace": True},
    {"regex": REGEX},
    {"choice": CHOICE},
    {"grammar": GRAMMAR},
]


def check(constraint: dict, text: str) -> None:
    """Fails unless `text` is a complete output of the constraint."""
    if "json" in constraint:
        jsonschema.validate(json.loads(text), constraint["json"])
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    elif "choice" in constraint:
        assert text in constraint["choice"], text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": rng.integers(3, 300, size=int(rng.integers(4, 40))).tolist()}
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


def _run(llm, prompts, constraint, **kw):
    params = SamplingParams(
        **{"temperature": 1.0, "seed": 7, "max_tokens": 160, **kw}, structured_outputs=constraint
    )
    return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


# ---- parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar or json_object must be set, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"regex": "a("}, "structured_outputs.regex"),
        ({"json": {"type": "foo"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": 3}, "structured_outputs.json must be a JSON schema"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"grammar": "start: foo"}, "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_name_their_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    with pytest.raises(ValueError, match="structured_outputs: .*unexpected keyword.*bogus"):
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="[ab]+")
    gbnf = StructuredOutputsParams(grammar='root ::= "a" [0-9]+')  # GBNF is taken too
    assert gbnf.kind == "grammar"


# ---- the device side ------------------------------------------------------------------------


def test_sampler_applies_the_bitmask_only_to_constrained_rows():
    """Row 0 may sample only tokens {3, 40, 77} (the best of them greedily; the others too at
    a high temperature); row 1 is free and samples its argmax."""
    from test_sampler import inputs

    vocab = 100
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, vocab)), jnp.float32)
    allowed = [3, 40, 77]
    words = np.zeros((2, -(-vocab // 32)), np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    words[1] = 0xFFFFFFFF
    mask = jnp.asarray(words.view(np.int32))
    jitted = jax.jit(sample)  # one program for every call (eagerly, each call took ~2 s)
    greedy = jitted(logits, replace(inputs(2, temperature=0.0, vocab=vocab), token_bitmask=mask))
    assert int(greedy.sampled[0]) == allowed[int(np.argmax(np.asarray(logits)[0, allowed]))]
    assert int(greedy.sampled[1]) == int(np.argmax(np.asarray(logits)[1]))
    seen = set()
    for seed in range(40):
        s = replace(inputs(2, temperature=50.0, seed=seed, vocab=vocab), token_bitmask=mask)
        out = jitted(logits, s)
        seen.add(int(out.sampled[0]))
    assert seen == set(allowed)


# ---- the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: next(iter(c)))
def test_random_model_outputs_match_their_constraint(llm, constraint):
    """12 prompts x n = 2, sampled at temperature 1: every output is complete and matches;
    nothing compiles after warmup."""
    compiled = llm.runner.num_compilations
    outs = _run(llm, _prompts(12), constraint, n=2)
    assert len(outs) == 24
    for c in outs:
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        check(constraint, c.text)
    assert len({c.text for c in outs}) >= 3  # sampled, not one forced string
    assert llm.runner.num_compilations == compiled, "a program compiled after warmup"


def test_free_requests_beside_constrained_ones_are_unchanged(llm):
    """A seeded free request gives the same tokens alone and in a batch full of constrained
    ones (their bitmask rows never touch its row)."""
    prompts = _prompts(6, seed=1)
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed = llm.generate(
        prompts * 2,
        [free] * 6 + [SamplingParams(temperature=1.0, seed=3, max_tokens=160,
                                     structured_outputs=c) for c in CONSTRAINTS * 2][:6],
        use_tqdm=False,
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[:6]] == alone
    for o, c in zip(mixed[6:], (CONSTRAINTS * 2)[:6], strict=True):
        check(c, o.outputs[0].text)


def test_preemption_keeps_the_matchers(tiny_model_dir, llm):
    """12 pages cannot hold 8 growing requests: some are preempted and recomputed, and their
    outputs equal the unpreempted engine's (the matcher kept the tokens it had consumed)."""
    small = LLM(tiny_model_dir, max_model_len=128, num_pages=12, max_num_seqs=8,
                max_num_batched_tokens=32)  # fmt: skip
    prompts = _prompts(8, seed=2)
    constraint = {"regex": r"([a-z]{2,5} ){6,9}[0-9]{1,3}"}
    got = _run(small, prompts, constraint, max_tokens=80)
    assert small.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    want = _run(llm, prompts, constraint, max_tokens=80)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c in got:
        check(constraint, c.text)


def test_speculative_decoding_verifies_against_the_grammar(tiny_model_dir, llm):
    """n-gram drafts are cut where the grammar refuses them and verified against masked rows:
    the outputs equal the engine's without speculation, and drafts were accepted."""
    spec = LLM(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
               "prompt_lookup_min": 1, "adaptive": False}, **ENGINE)  # fmt: skip
    # Prompts that repeat what the grammar wants, so n-gram drafts are proposed.
    tok = spec.tokenizer
    prompts = [{"prompt_token_ids": tok.encode("ab ab ab ab cd cd 12 " * 3)}] * 3
    constraint = {"regex": r"(ab |cd ){4,12}[0-9]{2}"}
    for temperature in (0.0, 1.0):
        kw = dict(temperature=temperature, max_tokens=60, n=2)
        got, want = _run(spec, prompts, constraint, **kw), _run(llm, prompts, constraint, **kw)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for c in got:
            check(constraint, c.text)
    assert spec.engine.stats().spec_decoding.num_accepted_tokens > 0


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_only(llm):
    """The engine-side bound on compile time: the request ends with finish_reason "error",
    and the request beside it completes."""
    manager = llm.engine.scheduler.structured_outputs
    manager.compile_timeout_s, saved = 0.0, manager.compile_timeout_s
    try:
        # Alone: its failure is still reported (the engine has nothing else to step for).
        alone = llm.generate(_prompts(1, seed=6), SamplingParams(
            max_tokens=8, structured_outputs={"regex": "[w]{1,7}y"}), use_tqdm=False)  # fmt: skip
        assert alone[0].outputs[0].finish_reason == "error"
        outs = llm.generate(
            _prompts(2, seed=5),
            [SamplingParams(max_tokens=8, structured_outputs={"regex": "[q]{1,7}z"}),
             SamplingParams(max_tokens=8, temperature=0)],
            use_tqdm=False,
        )  # fmt: skip
    finally:
        manager.compile_timeout_s = saved
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason in ("stop", "length")
