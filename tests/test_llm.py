"""The offline engine on a tiny random model: batching, scheduling, sampling, validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flax import nnx
from test_sampler import _numpy_penalties

from jaxllm import LLM, SamplingParams

from helpers import prefill_logits

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int = 0, vocab: int = 300) -> list[dict]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, size=n)
    return [{"prompt_token_ids": rng.integers(3, vocab, size=int(k)).tolist()} for k in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_idle(llm: LLM) -> None:
    kv = llm.kv_cache_manager
    kv.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_pages
    assert all(c == 0 for c in kv.ref_counts)


def test_batched_equals_alone(tiny_llm):
    prompts = _prompts(16)
    batched = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [tiny_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert _tokens(batched) == _tokens(alone)
    assert all(len(t) == 12 for t in _tokens(batched))
    assert all(o.outputs[0].finish_reason == "length" for o in batched)
    _assert_idle(tiny_llm)


def test_prompts_share_steps(tiny_llm):
    """Several prompts in one call run in the same batches, not one after another."""
    steps = tiny_llm.engine.num_steps
    tiny_llm.generate(_prompts(8, seed=1), GREEDY, use_tqdm=False)
    # 8 prompts of < 100 tokens fit the 128-token budget in a few chunks; 12 decode steps
    # each. One after another would take at least 8 * 12 steps.
    assert tiny_llm.engine.num_steps - steps < 2 * 12


def test_chunked_prefill_and_preemption_do_not_change_outputs(tiny_model_dir, tiny_llm):
    prompts = _prompts(12, seed=2)
    reference = _tokens(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))
    # A 16-token budget splits every long prompt into chunks; 10 pages of 16 tokens cannot
    # hold 8 running requests as they grow, so the newest are preempted and recomputed.
    small = LLM(
        tiny_model_dir, max_model_len=128, num_pages=10, max_num_seqs=8, max_num_batched_tokens=16
    )
    kv = small.kv_cache_manager
    step = small.engine.step

    def checked_step():
        updates = step()
        kv.check_invariants()
        return updates

    small.engine.step = checked_step
    assert _tokens(small.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert small.engine.scheduler.num_preemptions > 0
    _assert_idle(small)


def test_bad_inputs_raise_and_engine_keeps_serving(tiny_llm):
    cases = [
        ("", GREEDY, "prompt"),
        ({"prompt_token_ids": []}, GREEDY, "prompt"),
        ({"prompt_token_ids": [1] * 256}, GREEDY, "max_model_len"),
        ({"prompt_token_ids": [10**6]}, GREEDY, "prompt_token_ids"),
        ({"prompt_token_ids": ["a"]}, GREEDY, "prompt_token_ids"),
        (3, GREEDY, "prompt"),
    ]
    for prompt, params, name in cases:
        with pytest.raises(ValueError, match=name):
            tiny_llm.generate([{"prompt_token_ids": [5, 6]}, prompt], params, use_tqdm=False)
    for kwargs, name in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    _assert_idle(tiny_llm)
    out = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


def test_values_past_the_vocabulary(tiny_llm):
    """Issue 13, defect 1: a top_k past the vocabulary is off (as in vLLM); a stop id outside
    it is refused naming stop_token_ids (both used to overflow an int32 host array while the
    batch was built, failing every request of the step). min_tokens past any length is all."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    sampled = dict(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True)
    off = tiny_llm.generate(prompt, SamplingParams(**sampled), use_tqdm=False)
    huge = tiny_llm.generate(prompt, SamplingParams(**sampled, top_k=2**31), use_tqdm=False)
    assert _tokens(huge) == _tokens(off)
    out = tiny_llm.generate(
        prompt, SamplingParams(max_tokens=4, min_tokens=4, stop_token_ids=[5]), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="stop_token_ids: token id 2147483648 is outside"):
        tiny_llm.generate(
            [prompt, prompt],
            [GREEDY, SamplingParams(stop_token_ids=[2**31], min_tokens=1)],
            use_tqdm=False,
        )
    _assert_idle(tiny_llm)
    big_min = SamplingParams(max_tokens=None, min_tokens=2**40, ignore_eos=True)
    out = tiny_llm.generate(prompt, big_min, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    # The engine core refuses such a request on its own too (library callers of the core).
    from jaxllm.engine.request import Request

    bad = Request("x", [5, 6], SamplingParams(stop_token_ids=[10**6]), eos_token_ids=(),
                  max_tokens=4, seed=0)  # fmt: skip
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llm.engine.add_request(bad)
    _assert_idle(tiny_llm)


def test_string_prompts_and_chat(tiny_llm):
    out = tiny_llm.generate(["The quick brown fox", "Paris is"], GREEDY, use_tqdm=False)
    tok = tiny_llm.get_tokenizer()
    assert out[0].prompt == "The quick brown fox"
    assert out[0].prompt_token_ids == tok.encode("The quick brown fox")
    c = out[0].outputs[0]
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "Hello"}]
    chat = tiny_llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat.prompt == expected
    assert chat.prompt_token_ids == tok.encode(expected, add_special_tokens=False)


def test_stop_token_and_eos(tiny_llm):
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}
    free = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    out = tiny_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens: the stop token may not be sampled among the first 3 tokens, and its text
    # never shows.
    out = tiny_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[0]], min_tokens=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 4 and free[0] not in out.token_ids[:3]
    assert out.token_ids[0] != free[0]


def test_min_tokens_blocks_eos(tiny_llm):
    eos = tiny_llm.eos_token_ids[0]
    prompt = {"prompt_token_ids": [5, 6, 7]}
    force_eos = {eos: 100.0}
    first = tiny_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias=force_eos), use_tqdm=False
    )[0].outputs[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop" and first.text == ""
    out = tiny_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=5, min_tokens=2, logit_bias=force_eos),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 3 and eos not in out.token_ids[:2] and out.token_ids[2] == eos


def test_logit_bias_forces_and_bans_tokens(tiny_llm):
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}
    free = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    target = next(t for t in range(40, 300) if t not in free)
    for temperature in (0.0, 1.0):
        forced = tiny_llm.generate(
            prompt,
            SamplingParams(
                temperature=temperature, max_tokens=6, ignore_eos=True, logit_bias={target: 100}
            ),
            use_tqdm=False,
        )[0].outputs[0]
        assert forced.token_ids == [target] * 6
    banned = tiny_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={free[0]: -100}),
        use_tqdm=False,
    )[0].outputs[0]
    assert free[0] not in banned.token_ids
    vocab = tiny_llm.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_llm.generate(prompt, SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    _assert_idle(tiny_llm)


def test_penalties_through_the_engine_match_vllm_formula(tiny_llm):
    """Greedy decoding with penalties: every token is the argmax of the model's logits after
    vLLM's penalties over the prompt and the output so far."""
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 11, 12, 12, 12]  # greedy repeats 398, 310 after it
    # (presence, frequency, repetition): discouraging, encouraging output repeats, and a
    # repetition penalty < 1 that favours the prompt's tokens.
    cases = [(0.5, 0.8, 1.6), (-2.0, -1.0, 1.0), (0.0, 0.0, 0.5)]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            presence_penalty=p,
            frequency_penalty=f,
            repetition_penalty=r,
        )
        for p, f, r in cases
    ]
    # In one batch with requests without penalties, whose outputs must not change.
    others = _prompts(3, seed=4)
    outs = tiny_llm.generate(
        [{"prompt_token_ids": prompt}] * 3 + others, params + [GREEDY] * 3, use_tqdm=False
    )
    assert _tokens(outs[3:]) == _tokens(tiny_llm.generate(others, GREEDY, use_tqdm=False))
    free = _tokens(tiny_llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False))[0]
    runner = tiny_llm.runner
    model = nnx.merge(runner.graphdef, runner.state)
    changed = []
    for (presence, frequency, repetition), o in zip(cases, outs, strict=False):
        out = o.outputs[0].token_ids
        changed.append(out != free)
        logits = prefill_logits(model, runner.config, prompt + out)
        for j, token in enumerate(out):
            row = logits[len(prompt) - 1 + j]  # the logits that chose out[j]
            x = _numpy_penalties(row, prompt, out[:j], presence, frequency, repetition)
            assert token == int(x.argmax()), (presence, frequency, repetition, j)
    assert changed == [True] * 3  # each case changed the text
    _assert_idle(tiny_llm)


def test_stop_strings(tiny_llm):
    prompt = "Once upon a time"
    free = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    first = free.text.index(stop)
    out = tiny_llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == free.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = tiny_llm.generate(
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == free.text[: first + len(stop)]
    _assert_idle(tiny_llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llm):
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=1234, ignore_eos=True
    )
    target = {"prompt_token_ids": [11, 12, 13]}
    alone = tiny_llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(5, seed=3)
    mixed = tiny_llm.generate(
        [*others, target],
        [SamplingParams(temperature=0.8, max_tokens=8)] * 5 + [params],
        use_tqdm=False,
    )
    assert mixed[-1].outputs[0].token_ids == alone
    other_seed = tiny_llm.generate(
        target, SamplingParams(**{**params.__dict__, "seed": 99}), use_tqdm=False
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_completions(tiny_llm):
    out = tiny_llm.generate(
        {"prompt_token_ids": [4, 5, 6]},
        SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    _assert_idle(tiny_llm)


def test_logprobs(tiny_llm):
    out = tiny_llm.generate(
        {"prompt_token_ids": [4, 5, 6]},
        SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(ranked))
        assert all(lp.logprob <= 0 for lp in ranked)
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_max_tokens_clipped_to_context(tiny_llm):
    out = tiny_llm.generate(
        {"prompt_token_ids": [5] * 250},
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_no_compilation_for_repeated_shapes(tiny_llm):
    tiny_llm.generate(_prompts(4, seed=5), GREEDY, use_tqdm=False)
    before = tiny_llm.runner.num_compilations
    tiny_llm.generate(_prompts(4, seed=5), GREEDY, use_tqdm=False)
    assert tiny_llm.runner.num_compilations == before
    # Penalties and logit bias run in the programs compiled at warmup.
    extra = [
        SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, max_tokens=5, frequency_penalty=1.0, seed=1),
        SamplingParams(temperature=0, max_tokens=5, logit_bias={10: 5.0}),
        SamplingParams(temperature=0.5, max_tokens=5, presence_penalty=-1, logit_bias={11: -3}),
    ]
    tiny_llm.generate(_prompts(4, seed=6), extra, use_tqdm=False)
    tiny_llm.generate(_prompts(16, seed=7), (extra * 4)[:15] + [GREEDY], use_tqdm=False)
    assert tiny_llm.runner.num_compilations == before


def test_engine_recovers_from_a_failed_step(tiny_llm):
    prompt = {"prompt_token_ids": [9, 8, 7, 6, 5] * 8}
    ref = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    runner = tiny_llm.runner
    step = runner.forward

    def failing_step(state, cache, *args, **kwargs):
        cache.kv.data.delete()  # as a device fault after donation would leave it
        raise RuntimeError("simulated device fault")

    runner.forward = failing_step
    try:
        with pytest.raises(RuntimeError, match="simulated device fault"):
            tiny_llm.generate(prompt, GREEDY, use_tqdm=False)
    finally:
        runner.forward = step
    _assert_idle(tiny_llm)
    assert not runner.kv_cache.data.is_deleted() and not tiny_llm.kv_cache_manager.cached
    assert tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_priority_policy(tiny_model_dir, tiny_llm):
    with pytest.raises(ValueError, match="priority"):
        tiny_llm.generate({"prompt_token_ids": [5]}, GREEDY, priority=[1], use_tqdm=False)
    llm = LLM(tiny_model_dir, max_model_len=64, num_pages=16, max_num_seqs=1,
              max_num_batched_tokens=32, scheduling_policy="priority", skip_warmup=True)  # fmt: skip
    order = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        order.extend(r.request_id for r in out.requests if r.request_id not in order)
        return out

    llm.engine.scheduler.schedule = recording_schedule
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)]
    outs = llm.generate(prompts, GREEDY, priority=[2, 0, 1], use_tqdm=False)
    ids = [o.request_id for o in outs]
    # One seat: requests run one at a time, in priority order, whatever the arrival order.
    assert order == [ids[1], ids[2], ids[0]]
    with pytest.raises(ValueError, match="priority must be 3 integers"):
        llm.generate(prompts, GREEDY, priority=[0, 1], use_tqdm=False)


def test_prompt_logprobs(tiny_llm):
    """Every prompt token scored against the model's own logits, across a chunked prefill
    (200 tokens, 128 per step), beside a request without them and with a warm prefix cache
    (which a request wanting prompt logprobs must not use)."""
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 300, size=200).tolist()
    tiny_llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)  # cache the prefix
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    compilations = tiny_llm.runner.num_compilations
    out, other = tiny_llm.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:50]}],
        [params, GREEDY],
        use_tqdm=False,
    )
    assert tiny_llm.runner.num_compilations == compilations, "the scorer was warmed up"
    assert other.prompt_logprobs is None
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    runner = tiny_llm.runner
    logits = prefill_logits(nnx.merge(runner.graphdef, runner.state), runner.config, prompt)
    ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    for i in range(1, len(prompt)):
        entry, row = lps[i], ref[i - 1]
        token = prompt[i]
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top2 = np.argsort(-row)[:2]
        assert set(top2) <= set(entry), i
    _assert_idle(tiny_llm)


def test_async_scheduling_changes_no_output(tiny_model_dir, tiny_llm):
    """The same requests with async scheduling on (tiny_llm) and off: identical tokens,
    logprobs and texts, for greedy and seeded sampling, stop strings, min_tokens, n > 1 and
    penalties (which step synchronously), in one batch."""
    assert tiny_llm.engine.async_scheduling
    sync = LLM(
        tiny_model_dir,
        max_model_len=256,
        num_pages=128,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        async_scheduling=False,
    )
    free = tiny_llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].text
    kinds = [
        GREEDY,
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=16),
        SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0, max_tokens=16, stop=[free[3:6]], ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, min_tokens=8, max_tokens=12),
        SamplingParams(temperature=0.8, seed=6, n=3, max_tokens=10),
    ]
    prompts = ["Once upon a time", *_prompts(11, seed=9)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], [
            lp.logprob
            for o in outs
            for c in o.outputs
            for step in c.logprobs or []
            for lp in step.values()
        ]

    def same(a, b):
        assert a[0] == b[0]
        # Batches are cut differently, so float sums may round differently: logprobs agree
        # to float32 precision, and the top ids (the dict keys) exactly (in the tokens above).
        assert a[1] == pytest.approx(b[1], abs=1e-4)

    # The async engine really launches a step while the one before it is in flight.
    engine, overlapped = tiny_llm.engine, []
    launch = engine.runner.launch

    def counting_launch(out):
        overlapped.append(engine._inflight is not None)
        return launch(out)

    engine.runner.launch = counting_launch
    try:
        async_run = run(tiny_llm)
    finally:
        del engine.runner.launch
    assert sum(overlapped) > len(overlapped) // 2, overlapped
    same(async_run, run(sync))
    # With a penalized request in the batch the async engine steps synchronously meanwhile.
    params[1] = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.4)
    same(run(tiny_llm), run(sync))
    _assert_idle(tiny_llm)
    _assert_idle(sync)


def test_gpu_sampler_variants_serve_what_the_one_program_serves(tiny_model_dir, tiny_llm,
                                                               monkeypatch):  # fmt: skip
    """An engine with a GPU's sampler programs (greedy, logprobs, random, everything; no
    run-time skips), here on the CPU: each step's batch goes to the first variant that holds
    what it needs, as the batch's needs change from step to step (requests finishing, a
    min_tokens block lifting), and every request's tokens and logprobs equal those of the one
    program that skips at run time; nothing compiles after warmup."""
    from jaxllm.worker.sampler import SamplerVariant

    gpu = SamplerVariant.for_platform("gpu")
    monkeypatch.setattr(SamplerVariant, "for_platform", staticmethod(lambda _: gpu))
    llm = LLM(tiny_model_dir, max_model_len=256, num_pages=128, max_num_seqs=16,
              max_num_batched_tokens=128)  # fmt: skip
    assert tuple(llm.runner.head_and_sample) == gpu
    compiled = llm.runner.num_compilations

    # The biased, penalized and min_tokens requests end first; in the first workload then the
    # sampled ones, then the greedy ones with logprobs, in the second the other way round: the
    # last steps of each need less and less of the sampler.
    def workload(sampled: int, with_logprobs: int) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=with_logprobs, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=sampled, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=3, logprobs=3),
            SamplingParams(temperature=1.0, seed=5, min_tokens=2, max_tokens=3),
            SamplingParams(temperature=0, max_tokens=3, logit_bias={7: 5.0}, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.4, ignore_eos=True),
        ]

    used = []
    pick = llm.runner.sampler_variant
    monkeypatch.setattr(llm.runner, "sampler_variant", lambda needs: used.append(pick(needs))
                        or used[-1])  # fmt: skip

    def run(engine, kinds):
        prompts = _prompts(len(kinds) * 2, seed=21)
        params = [kinds[i % len(kinds)] for i in range(len(prompts))]
        outs = engine.generate(prompts, params, use_tqdm=False)
        lps = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []]
               for o in outs]  # fmt: skip
        return _tokens(outs), lps

    for kinds in (workload(6, 10), workload(10, 6)):
        tokens, logprobs = run(llm, kinds)
        want_tokens, want_logprobs = run(tiny_llm, kinds)
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert [g.keys() for g in got] == [w.keys() for w in want]
            flat = lambda steps: [v for step in steps for v in step.values()]  # noqa: E731
            assert flat(got) == pytest.approx(flat(want), abs=1e-5)
    assert {v.name for v in used} == {v.name for v in gpu}  # every variant served some step
    assert llm.runner.num_compilations == compiled
    _assert_idle(llm)
