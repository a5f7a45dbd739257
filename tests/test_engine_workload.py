"""A random mixed workload through the engine after warmup: 240 requests with prompt lengths
from 1 to near max_model_len, mixed max_tokens, shared long prefixes, mid-way aborts, a pool too
small for everything at once (so preemption happens). Asserts after every step that the block
pool is consistent, that nothing compiles after warmup, and that every finished request's
output equals the output of running it alone on a separate engine without prefix caching.
Runs with async scheduling on and off (a share of the requests has penalties or a grammar,
under which the async engine steps synchronously, so it switches between the two), and with 80 requests
on a Gemma 3 (sliding-window and global layers) and a Qwen3-MoE checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.request import Request
from jaxllm.loaders import load_config
from jaxllm.worker.kv_groups import kv_cache_groups

from helpers import write_family_checkpoint

MAX_MODEL_LEN = 256


def _workload(rng: np.random.Generator, vocab: int, n: int = 240):
    prefixes = [rng.integers(3, vocab, size=int(k)).tolist() for k in (96, 150, 200)]
    work = []
    for i in range(n):
        if rng.random() < 0.35:
            prefix = prefixes[int(rng.integers(len(prefixes)))]
            suffix = rng.integers(3, vocab, size=int(rng.integers(1, 40))).tolist()
            prompt = (prefix + suffix)[: MAX_MODEL_LEN - 2]
        else:
            prompt = rng.integers(3, vocab, size=int(rng.integers(1, MAX_MODEL_LEN - 1))).tolist()
        max_tokens = int(min(rng.integers(1, 24), MAX_MODEL_LEN - len(prompt)))
        kind = rng.random()
        if kind < 0.75:
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5
            )
        elif kind < 0.85:  # greedy with logprobs: the general sampler variant
            params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
        elif kind < 0.9:  # penalties: the token history travels from the host
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens, repetition_penalty=1.3, ignore_eos=True
            )
        elif kind < 0.95:  # seeded sampling: also reproducible alone
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens)
        else:  # structured outputs: a grammar's bitmask, synchronous steps
            params = SamplingParams(
                temperature=1.0, seed=i, max_tokens=max_tokens,
                structured_outputs={"regex": r"[a-z]{1,6}( [a-z0-9]{1,6}){0,12}\."},
            )  # fmt: skip
        work.append((f"req-{i}", prompt, params))
    return work


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """{name: checkpoint}; the transformers-written families are written on first use."""
    dirs = {"llama": tiny_model_dir}

    def get(name: str):
        if name not in dirs:
            pytest.importorskip("torch")
            dirs[name] = tmp_path_factory.mktemp(name)
            write_family_checkpoint(name, dirs[name])
        return dirs[name]

    return get


def same_bytes(model: Path, num_pages: int) -> int:
    """The pages of `model`'s KV cache that take the bytes of `num_pages` pages of every
    layer (a hybrid model's pages hold one layer group: `jaxllm.worker.kv_groups`)."""
    config = load_config(model)
    return num_pages * config.num_layers // kv_cache_groups(config).num_slots


@pytest.fixture(scope="module")
def alone_outputs():
    """Each request's output when run alone, on an engine per model, computed once for every
    run of the test."""
    engines: dict = {}
    cache: dict[tuple, list[int]] = {}

    def get(model, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        if model not in engines:
            engines[model] = LLM(
                model,
                max_model_len=MAX_MODEL_LEN,
                num_pages=same_bytes(model, 32),
                max_num_seqs=8,
                max_num_batched_tokens=256,
                enable_prefix_caching=False,
                skip_warmup=True,
            )
        if (model, rid) not in cache:
            out = engines[model].generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            cache[model, rid] = out[0].outputs[0].token_ids
        return cache[model, rid]

    return get


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


@pytest.mark.parametrize(
    "model,async_scheduling,num_requests,spec",
    [
        ("llama", True, 240, None),
        pytest.param("llama", False, 240, None, marks=pytest.mark.slow),
        pytest.param("gemma3", True, 80, None, marks=pytest.mark.slow),
        pytest.param("qwen3-moe", True, 80, None, marks=pytest.mark.slow),
        ("llama", True, 240, NGRAM),
        pytest.param("llama", True, 80, "draft", marks=pytest.mark.slow),
    ],
    ids=["async", "sync", "gemma3", "qwen3-moe", "spec-ngram", "spec-draft"],
)
def test_random_workload_no_recompilation_and_outputs_match_alone(
    model_dirs, alone_outputs, model, async_scheduling, num_requests, spec, request
):
    """With speculative decoding (n-gram, or the model as its own draft) the outputs still
    equal each request's alone without it."""
    if spec == "draft" and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with -m slow (test_spec_decode.py checks the draft model)")
    name, model = model, model_dirs(model)
    if spec == "draft":
        spec = {"model": str(model), "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(
        model,
        max_model_len=MAX_MODEL_LEN,
        # 1024 token slots of every layer for up to 16 running requests of up to 256 tokens;
        # half that for Gemma 3, whose sliding layers keep only their window (kv_groups).
        num_pages=same_bytes(model, 32 if name == "gemma3" else 64),
        max_num_seqs=16,
        max_num_batched_tokens=128,
        async_scheduling=async_scheduling,
        speculative_config=spec,
    )
    runner, core, kv = llm.runner, llm.engine, llm.kv_cache_manager
    compiles_after_warmup = runner.num_compilations
    rng = np.random.default_rng(0)
    work = _workload(rng, llm.model_config.vocab_size, num_requests)
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in work}
    finished: set[str] = set()
    aborted: set[str] = set()
    pending = list(work)
    running_ids: list[str] = []

    for _ in range(20_000):  # a bound, so a scheduling deadlock fails instead of hanging
        if not (pending or core.has_unfinished_requests()):
            break
        num_arrivals = int(rng.integers(0, 6))  # requests arrive over time
        arrivals, pending = pending[:num_arrivals], pending[num_arrivals:]
        for rid, prompt, params in arrivals:
            request = Request(
                rid,
                prompt,
                params,
                eos_token_ids=llm.eos_token_ids,
                max_tokens=params.max_tokens,
                seed=params.seed or 0,
            )
            core.add_request(request)
            running_ids.append(rid)
        if running_ids and rng.random() < 0.08:  # abort a random live request mid-way
            live = [r for r in running_ids if r not in finished and r not in aborted]
            if live:
                victim = live[int(rng.integers(len(live)))]
                core.abort_requests([victim])
                aborted.add(victim)
        for update in core.step():
            outputs[update.request_id].extend(update.new_token_ids)
            if update.finish_reason is not None:
                finished.add(update.request_id)
        kv.check_invariants()

    assert not pending and not core.has_unfinished_requests(), "the workload did not drain"
    assert runner.num_compilations == compiles_after_warmup, "a program compiled after warmup"
    assert kv.num_free_blocks == kv.num_pages and all(c == 0 for c in kv.ref_counts)
    assert core.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert kv.prefix_cache_hits > 0, "the shared prefixes were meant to hit the cache"
    assert len(finished) + len(aborted) == len(work) and len(aborted) >= 5
    if spec is not None:
        stats = core.stats()
        assert 0 < stats.spec_decoding.num_accepted_tokens <= stats.spec_decoding.num_draft_tokens

    mismatches = []
    for rid, prompt, params in work:
        if rid in aborted:
            continue
        ref = alone_outputs(model, rid, prompt, params)
        if ref != outputs[rid]:
            mismatches.append(f"{rid} (prompt {len(prompt)} tokens): {outputs[rid]} != alone {ref}")
    assert not mismatches, "\n".join(mismatches[:10])
