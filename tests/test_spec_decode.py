"""Speculative decoding: n-gram and draft-model proposers, verified in the target's step.

The output with speculation is the output without it, token for token, greedy or seeded
random (see `jaxllm.spec_decode`); the random workload with speculation is in
test_engine_workload.py."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig, SpeculativeConfig, add_cli_args
from jaxllm.testing import write_tiny_checkpoint
from jaxllm.worker.spec_decode.ngram import NgramProposer

ENGINE = dict(max_model_len=256, num_pages=96, max_num_seqs=8, max_num_batched_tokens=64)
# Speculation in every step (`adaptive` would pause it where it does not pay: see
# tests/test_spec_policy.py): these tests are of the verification.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


def _prompts(seed: int = 0) -> list[dict]:
    """Prompts whose continuations repeat them (so drafts are proposed and some accepted)
    and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        if i % 2:
            unit = rng.integers(3, 300, size=int(rng.integers(3, 9))).tolist()
            out.append({"prompt_token_ids": (unit * 6)[: int(rng.integers(10, 50))]})
        else:
            out.append(
                {"prompt_token_ids": rng.integers(3, 300, size=int(rng.integers(5, 80))).tolist()}
            )
    return out


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizer_dir):
    """A smaller random model with the target's vocabulary (1 layer, width 32)."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-draft"),
        tokenizer_dir,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        seed=7,
    )


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture(scope="module")
def ngram(tiny_model_dir):
    return LLM(tiny_model_dir, speculative_config=NGRAM, **ENGINE)


# ---- configuration ---------------------------------------------------------------------


def test_config_follows_vllm_and_names_what_is_wrong():
    spec = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 4}).method
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    spec = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_max": 3}).method  # fmt: skip
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    spec = SpeculativeConfig('{"model": "/m", "num_speculative_tokens": 2}').method  # JSON text
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/m", 2)
    assert SpeculativeConfig().method is None
    for name in ("mtp", "deepseek_mtp"):  # (vLLM's older name) the target's own layers
        spec = SpeculativeConfig({"method": name, "num_speculative_tokens": 2}).method
        assert (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", None, 2)
    assert SpeculativeConfig({"method": "mtp"}).method.num_speculative_tokens == 1  # (vLLM's)
    spec = SpeculativeConfig(
        {
            "method": "eagle3",
            "model": "/h",
            "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 1,
        }
    ).method  # (vLLM's docs pass it)
    assert (spec.method, spec.model) == ("eagle3", "/h")
    bad = [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min (4) must be <="),
        ({"method": "eagle9", "num_speculative_tokens": 2}, "method must be ngram, draft_model, eagle3 or mtp"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}, "unknown key(s) lookup"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "mtp", "num_speculative_tokens": 2, "model": 5}, "mtp's model must be a path"),
        ({"method": "mtp", "draft_tensor_parallel_size": 0}, "draft_tensor_parallel_size must be"),
        ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "is for ngram"),
        ("{not json", "not valid JSON"),
        (5, "speculative_config must be dict or None"),
    ]  # fmt: skip
    for value, message in bad:
        with pytest.raises(ValueError, match="speculative_config") as e:
            SpeculativeConfig(value)
        assert message in str(e.value)


def test_command_line_takes_vllm_json():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["m", "--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 3, "prompt_lookup_max": 4}'])  # fmt: skip
    spec = EngineConfig.from_cli(args).speculative.method
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 4)


def test_draft_model_must_share_the_vocabulary(tiny_model_dir, tokenizer_dir, tmp_path):
    other = write_tiny_checkpoint(tmp_path, tokenizer_dir, num_layers=1, vocab_size=512)
    with pytest.raises(ValueError, match="draft model's vocabulary"):
        LLM(tiny_model_dir, speculative_config={"model": str(other), "num_speculative_tokens": 2},
            skip_warmup=True, **ENGINE)  # fmt: skip


# ---- the n-gram proposer ---------------------------------------------------------------


def test_ngram_proposer():
    propose = NgramProposer(k=4, min_n=2, max_n=3).propose_after
    # vLLM's example: [4, 2, 3] has no earlier match, [2, 3] matches at 1: what followed it.
    assert propose(np.array([1, 2, 3, 4, 2, 3])) == [4, 2, 3]
    assert propose(np.array([1, 2, 3, 4, 5])) == []  # no earlier [4, 5]
    assert propose(np.array([7, 7])) == []  # too short for a match followed by a token
    # The longest match wins over a later shorter one; among equals, the latest.
    tokens = np.array([9, 2, 3, 50, 51, 8, 2, 3, 60, 61, 9, 2, 3])
    assert propose(tokens) == [50, 51, 8, 2]  # [9, 2, 3] at 0
    assert NgramProposer(k=2, min_n=2, max_n=2).propose_after(tokens) == [60, 61]  # [2, 3] at 6
    assert NgramProposer(k=3, min_n=1, max_n=1).propose_after(np.array([5, 1, 5, 2, 5])) == [2, 5]


# ---- exactness ---------------------------------------------------------------------------


def test_greedy_and_seeded_outputs_equal_no_speculation(plain, ngram):
    """Greedy, seeded random (with top-k/top-p), logprobs, penalties, min_tokens and n > 1:
    every token equals the engine's without speculation, and drafts were accepted."""
    prompts = _prompts()
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=40,
                       ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.2,
                       frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=24, min_tokens=20),
    ]  # fmt: skip
    compiled = ngram.runner.num_compilations
    before = ngram.engine.stats()
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = ngram.generate(prompts, params, use_tqdm=False)
        assert _tokens(got) == _tokens(want), params
        if params.logprobs:
            for a, b in zip(want, got, strict=True):
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    stats = ngram.engine.stats()
    assert ngram.runner.num_compilations == compiled, "a program compiled after warmup"
    assert stats.spec_decoding.num_draft_tokens > before.spec_decoding.num_draft_tokens + 200
    assert stats.spec_decoding.num_accepted_tokens > before.spec_decoding.num_accepted_tokens + 50
    assert sum(stats.spec_decoding.num_accepted_per_pos) == stats.spec_decoding.num_accepted_tokens


def test_stop_strings_and_tokens_end_inside_accepted_drafts(plain, ngram):
    """A stop inside a run of accepted drafts drops the tokens after it."""
    prompt = {"prompt_token_ids": [40, 41, 42, 43] * 8}
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    stop_id = free.token_ids[9]
    for params in (
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=30, stop=[free.text[12:16]]),
        SamplingParams(temperature=0, max_tokens=7),
    ):
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = ngram.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason,
        )  # fmt: skip


def test_seed_gives_the_same_text_alone_or_batched(ngram):
    prompts = _prompts(seed=3)
    params = SamplingParams(temperature=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    batched = _tokens(ngram.generate(prompts, params, use_tqdm=False))
    alone = [_tokens(ngram.generate(p, params, use_tqdm=False))[0] for p in prompts]
    assert batched == alone


def test_chunked_prefill_and_preemption(tiny_model_dir, plain):
    """A 16-token budget chunks every prompt (drafts are cut to the budget); 12 pages cannot
    hold 8 growing requests, so some are preempted and recomputed."""
    small = LLM(tiny_model_dir, max_model_len=128, num_pages=12, max_num_seqs=8,
                max_num_batched_tokens=16, speculative_config=NGRAM)  # fmt: skip
    prompts = _prompts(seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert _tokens(small.generate(prompts, params, use_tqdm=False)) == _tokens(
        plain.generate(prompts, params, use_tqdm=False)
    )
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.stats().spec_decoding.num_accepted_tokens > 0
    small.kv_cache_manager.check_invariants()
    assert small.kv_cache_manager.num_free_blocks == 12


def test_draft_model(tiny_model_dir, draft_dir, plain):
    """A smaller draft model of the same vocabulary: outputs equal the target's alone, with
    nothing compiled after warmup. The target as its own draft accepts every greedy draft."""
    prompts = _prompts(seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, max_tokens=24, ignore_eos=True),
    ]
    for draft in (draft_dir, tiny_model_dir):
        llm = LLM(tiny_model_dir, speculative_config={"model": str(draft), "adaptive": False,
                  "num_speculative_tokens": 3}, **ENGINE)  # fmt: skip
        compiled = llm.runner.num_compilations
        for p in params:
            assert _tokens(llm.generate(prompts, p, use_tqdm=False)) == _tokens(
                plain.generate(prompts, p, use_tqdm=False)
            )
        assert llm.runner.num_compilations == compiled
        stats = llm.engine.stats()
        assert stats.spec_decoding.num_draft_tokens > 300
        if draft == tiny_model_dir:
            greedy = llm.engine.stats()
            llm.generate(prompts, params[0], use_tqdm=False)
            after = llm.engine.stats()
            drafted = after.spec_decoding.num_draft_tokens - greedy.spec_decoding.num_draft_tokens
            assert (
                after.spec_decoding.num_accepted_tokens - greedy.spec_decoding.num_accepted_tokens
                == drafted
            )


@pytest.mark.parametrize("n", [2048, pytest.param(20_480, marks=pytest.mark.slow)])
def test_distribution_equals_the_targets(tiny_model_dir, plain, n, request):
    """n seeded samples of three tokens (top-k 3, so 27 outcomes) with the target as
    its own greedy draft, which makes the first and second drafts be accepted sometimes and
    rejected sometimes: the frequencies match the target's exact probabilities (a chi-square
    test at p = 0.001), and the acceptance rate matches the probability the draft is drawn."""
    if n > 2048 and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with -m slow")
    prompt = {"prompt_token_ids": [17, 99, 240, 61, 5, 133]}
    params = dict(temperature=1.3, top_k=3, max_tokens=3, ignore_eos=True)
    # Exact probabilities: the top 3 of each distribution, renormalised (logprobs are raw).
    probs: dict[tuple[int, ...], float] = {}

    def top3(prefix: list[int]) -> dict[int, float]:
        out = plain.generate({"prompt_token_ids": prompt["prompt_token_ids"] + prefix},
                             SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                             use_tqdm=False)[0].outputs[0]  # fmt: skip
        lps = {t: lp.logprob / params["temperature"] for t, lp in out.logprobs[0].items()}
        top = sorted(lps, key=lps.get, reverse=True)[:3]
        z = sum(math.exp(lps[t]) for t in top)
        return {t: math.exp(lps[t]) / z for t in top}

    for a, pa in top3([]).items():
        for b, pb in top3([a]).items():
            for c, pc in top3([a, b]).items():
                probs[a, b, c] = pa * pb * pc
    llm = LLM(tiny_model_dir, max_model_len=64, num_pages=600, max_num_seqs=256,
              max_num_batched_tokens=1024,
              speculative_config={"model": str(tiny_model_dir), "num_speculative_tokens": 2,
                                  "adaptive": False})  # fmt: skip
    outs = llm.generate([prompt] * n, [SamplingParams(seed=s, **params) for s in range(n)],
                        use_tqdm=False)  # fmt: skip
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        assert key in probs, key
        counts[key] = counts.get(key, 0) + 1
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())
    # The 0.999 quantile of chi-square with 26 degrees of freedom is 54.05.
    assert chi2 < 54.05, (chi2, counts)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens


def test_metrics_under_vllm_names():
    from jaxllm.engine.core_outputs import SpecDecodingStats, Stats
    from server.metrics import Metrics
    from tests.test_metrics import fake_engine

    stats = Stats(spec_decoding=SpecDecodingStats(4, 12, 7, [4, 2, 1]))  # fmt: skip
    text = Metrics(fake_engine(stats), "m").render().decode()
    labels = 'engine="0",model_name="m"'
    for line in (
        f"vllm:spec_decode_num_drafts_total{{{labels}}} 4.0",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 12.0",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 7.0",
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 4.0',
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="2"}} 1.0',
    ):
        assert line in text.splitlines(), line
