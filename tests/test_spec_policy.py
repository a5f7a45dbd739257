"""Speculation that never costs (`jaxllm.engine.spec_policy`): the scheduler speculates only at
batch sizes where speculating steps were measured to give more tokens a second, and a paused
proposer keeps its cache whole, so the output is the target's and the drafts after a pause are
the drafts of a run that never paused."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import SpeculativeConfig
from jaxllm.engine.spec_policy import SpeculationPolicy
from jaxllm.testing import write_tiny_checkpoint, write_tiny_eagle3_head

ENGINE = dict(max_model_len=256, num_pages=96, max_num_seqs=8, max_num_batched_tokens=64)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(policy, clock, steps, *, batch, ways, stall=None):
    """`steps` decode steps of `batch` requests, each way w costing `ways[w]` = (tokens a
    request gets, seconds a step), step `stall` 10 seconds more: the ways the steps ran."""
    ran = []
    for i in range(steps):
        w = policy.speculate(batch)
        tokens, seconds = ways[w]
        clock.now += seconds + (10.0 if i == stall else 0.0)
        policy.observe(batch, w, batch * tokens)
        ran.append(w)
    return ran


# k = 3 drafts: 2.5 tokens a step; 1 draft: 1.6; plain: 1.
GPU_LIKE = {3: (2.5, 1.2), 1: (1.6, 1.05), 0: (1, 1.0)}  # wider steps cost little
CPU_LIKE = {3: (2.5, 3.0), 1: (1.6, 1.4), 0: (1, 1.0)}  # they cost their width


def test_takes_the_fastest_way_after_probing_each():
    clock = _Clock()
    policy = SpeculationPolicy(3, probe_steps=4, reprobe_steps=10_000, clock=clock)
    ran = _run(policy, clock, 40, batch=1, ways=GPU_LIKE)
    # 4 measured steps of k drafts (the first step of a way is not measured); one draft and
    # none give under 80% of its rate after 3 steps: their probes end there; then the
    # fastest, every draft.
    assert ran[:13] == [3] * 5 + [1] * 4 + [0] * 4 and set(ran[13:]) == {3}
    # At batch 32 the same proposer pays only with one draft (1.6 / 1.4 > 1 > 2.5 / 3): k
    # drafts first (the fastest at batch 1), then one, then none.
    ran = _run(policy, clock, 40, batch=32, ways=CPU_LIKE)
    assert ran[:15] == [3] * 5 + [1] * 5 + [0] * 5 and set(ran[15:]) == {1}
    # Batch sizes are bucketed by powers of two: 20 requests run as 32 do.
    assert policy.speculate(20) == 1 and policy.speculate(1) == 3
    assert policy.rates() == {
        "1:0": 1.0, "1:1": 1.52, "1:3": 2.08, "32:0": 32.0, "32:1": 36.57, "32:3": 26.67
    }  # fmt: skip
    # Batch 8 (between them, so no fewer than one draft) first tries one, the fastest at the
    # nearest measured size; k drafts, clearly slower, end their probe after 3 steps.
    ran = _run(policy, clock, 30, batch=8, ways=CPU_LIKE | {3: (2.5, 6.0)})
    assert ran[:9] == [1] * 5 + [3] * 4 and set(ran[9:]) == {1}


def test_a_stalled_step_does_not_decide():
    clock = _Clock()
    policy = SpeculationPolicy(3, probe_steps=8, clock=clock)
    # Plain decode is faster, but one of its probe's steps stalls for 10 steps' time.
    ways = {3: (1.2, 2.0), 1: (1.1, 1.5), 0: (1, 1.0)}
    ran = _run(policy, clock, 60, batch=1, ways=ways, stall=21)
    assert ran[21] == 0 and set(ran[27:]) == {0}


def test_batch_sizes_not_measured_follow_the_measured_ones():
    clock = _Clock()
    policy = SpeculationPolicy(3, probe_steps=4, reprobe_steps=10_000, clock=clock)
    _run(policy, clock, 20, batch=4, ways=CPU_LIKE)  # one draft is fastest at 4
    # Wider batches gain less: 8 tries one draft and none, not three.
    ran = _run(policy, clock, 20, batch=8, ways={3: (2.5, 3.0), 1: (1.6, 2.0), 0: (1, 1.0)})
    assert ran[:10] == [1] * 5 + [0] * 5 and set(ran[10:]) == {0}
    # 64 neither (only batch sizes measured every way say something of others).
    ran = _run(policy, clock, 20, batch=64, ways={3: (2.5, 3.0), 1: (1.6, 2.0), 0: (1, 1.0)})
    assert 3 not in ran and set(ran[10:]) == {0}
    # Narrower: 2 tries one draft (the fastest at 4, the nearest) and three, not none.
    ran = _run(policy, clock, 20, batch=2, ways=GPU_LIKE)
    assert ran[:10] == [1] * 5 + [3] * 5 and set(ran[10:]) == {3}


def test_measures_the_other_ways_again_and_follows_the_traffic():
    clock = _Clock()
    policy = SpeculationPolicy(3, probe_steps=4, reprobe_steps=50, clock=clock)
    poor = {3: (1.1, 2.0), 1: (1.05, 1.4), 0: (1, 1.0)}  # a poor proposer
    assert set(_run(policy, clock, 30, batch=4, ways=poor)[15:]) == {0}
    # The traffic turns copy-heavy: once the stale figures are measured again, it speculates.
    ran = _run(policy, clock, 100, batch=4, ways={3: (3.5, 2.0), 1: (1.9, 1.4), 0: (1, 1.0)})
    first = ran.index(3)
    assert 20 <= first <= 45 and set(ran[first + 15 : first + 45]) == {3}


def test_steps_that_say_nothing_are_not_measured():
    clock = _Clock()
    policy = SpeculationPolicy(3, probe_steps=2, clock=clock)
    for _ in range(10):  # prompt chunks in every step: nothing is learned
        clock.now += 1
        policy.observe(None, 3, 1)
    assert policy.num_steps == 0 and policy.speculate(1) == 3
    # The first step of a way, and a step after one of another batch size, are not measured.
    for batch, way in ((1, 3), (2, 3), (1, 3), (1, 0), (2, 0)):
        clock.now += 1
        policy.observe(batch, way, batch)
    assert policy.num_steps == 0


def test_disable_by_batch_size_and_not_adaptive():
    always = SpeculationPolicy(4, adaptive=False)
    assert always.speculate(1) == always.speculate(512) == 4
    bounded = SpeculationPolicy(4, adaptive=False, disable_by_batch_size=8)
    assert bounded.speculate(7) == 4 and bounded.speculate(8) == 0
    assert SpeculationPolicy(1).ways == (1, 0)
    spec = SpeculativeConfig(
        {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}
    ).method
    assert (spec.adaptive, spec.disable_by_batch_size, spec.may_pause) == (True, 4, True)
    spec = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    assert not spec.method.may_pause


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"adaptive": "yes"}, "adaptive must be true or false"),
        ({"disable_by_batch_size": 0}, r"disable_by_batch_size must be an integer in \[1,"),
        ({"disable_by_batch_size": 2.5}, "disable_by_batch_size must be an integer"),
    ],
)
def test_bad_settings_are_named(extra, message):
    with pytest.raises(ValueError, match=message):
        _ = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 2, **extra}).method


# ---- in the engine ---------------------------------------------------------------------------


class _Pattern(SpeculationPolicy):
    """Verifies every draft in 2 steps, one draft in 1, then pauses for 2, by the steps whose
    output came back."""

    def __init__(self):
        super().__init__(3)
        self.steps = self.paused = 0

    def speculate(self, num_running: int) -> int:
        return (3, 3, 1, 0, 0)[self.steps % 5]

    def observe(self, num_decodes, num_drafts, num_tokens) -> None:
        self.steps += 1
        self.paused += not num_drafts


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture(scope="module")
def proposers(tmp_path_factory, tiny_model_dir, tokenizer_dir):
    draft = write_tiny_checkpoint(
        tmp_path_factory.mktemp("draft"), tokenizer_dir, num_layers=1, hidden_size=32,
        intermediate_size=64, num_heads=2, num_kv_heads=1, seed=7,
    )  # fmt: skip
    head = write_tiny_eagle3_head(
        tmp_path_factory.mktemp("head"), tiny_model_dir, draft_vocab_size=200,
        aux_layers=[0, 1, 2],
    )  # fmt: skip
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft_model": {"model": str(draft), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    }


def _prompts(seed: int, n: int = 6) -> list[dict]:
    rng = np.random.default_rng(seed)
    # Repeats inside, so that n-gram drafts exist and are sometimes accepted.
    return [
        {"prompt_token_ids": np.tile(rng.integers(3, 300, size=int(rng.integers(4, 12))), 3)
         .tolist()}
        for _ in range(n)
    ]  # fmt: skip


def _recorded(llm) -> dict[tuple[int, int], list[int]]:
    """The drafts `llm`'s proposer returns from now on, by (batch row's request order, the
    sequence length they follow)."""
    proposed: dict[tuple[str, int], list[int]] = {}
    runner = llm.runner
    propose = runner.proposer.propose

    def recording(launched, held):
        drafts = propose(launched, held)
        for rid, _, row in held:
            proposed[(rid, int(runner.input_batch.num_tokens[row]))] = drafts[rid]
        return drafts

    runner.proposer.propose = recording
    return proposed


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_paused_speculation_is_exact(tiny_model_dir, plain, proposers, method):
    """Steps that speculate and steps that do not, in turns (plain ones scheduled ahead, as
    the engine does without speculation): greedy and seeded output equal the target's alone,
    the fill programs were compiled at warmup and nothing after, and the drafts proposed after
    a pause equal those of a run that never paused (the proposer's cache stayed whole, and its
    fill read the tokens the target read where steps overlap)."""
    spec = proposers[method]
    llm = LLM(tiny_model_dir, speculative_config=spec, **ENGINE)
    names = {p.name for p in llm.runner.compiler.programs}
    if method != "ngram":
        fill = "eagle3_fill" if method == "eagle3" else "draft_fill"
        assert fill in names
    compiled = llm.runner.num_compilations
    pattern = _Pattern()
    llm.engine.scheduler.speculation = pattern
    drafts = _recorded(llm)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True),
    ]
    prompts = _prompts(3)
    for p in params:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, p)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        assert got == want
    assert pattern.paused > 10 and llm.engine.stats().spec_decoding.num_drafts > 10
    assert llm.runner.num_compilations == compiled
    if method == "ngram":
        return  # its drafts are read from the sequence: no cache to keep
    # The same greedy requests with speculation in every step: the same drafts where both
    # proposed. A proposer that skipped its cache in paused steps fails this.
    always = LLM(tiny_model_dir, speculative_config=spec | {"adaptive": False}, **ENGINE)
    reference = _recorded(always)
    greedy = params[:1]
    drafts.clear()
    llm.generate(prompts, greedy[0])
    always.generate(prompts, greedy[0])
    order = {rid: i for i, rid in enumerate(sorted({r for r, _ in drafts}, key=int))}
    order_ref = {rid: i for i, rid in enumerate(sorted({r for r, _ in reference}, key=int))}
    mine = {(order[r], n): d for (r, n), d in drafts.items()}
    theirs = {(order_ref[r], n): d for (r, n), d in reference.items()}
    both = sorted(set(mine) & set(theirs))
    assert len(both) > 20
    assert all(mine[key] == theirs[key] for key in both)


def test_get_metrics_as_vllm_reads_them(tiny_model_dir, proposers):
    """vLLM's offline spec-decode example reads `LLM.get_metrics()` this way."""
    from jaxllm.metrics_reader import Counter, Vector

    llm = LLM(tiny_model_dir, speculative_config=proposers["ngram"] | {"adaptive": False},
              **ENGINE)  # fmt: skip
    llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * 3
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector) and len(metric.values) == 3
            per_pos = [a + b for a, b in zip(per_pos, metric.values, strict=True)]
    stats = llm.engine.stats().spec_decoding
    assert drafts == stats.num_drafts > 0 and draft_tokens == stats.num_draft_tokens
    assert accepted == stats.num_accepted_tokens == sum(per_pos) > 0
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
