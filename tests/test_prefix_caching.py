"""Automatic prefix caching: chained block keys, LRU eviction of freed cached blocks, and a
second request over a shared 1000-token prefix computing only its new tokens."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.block_hashing import BlockHasher
from jaxllm.engine.kv_cache_manager import KVCacheManager
from tests.helpers import admit, book_request

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_keys_chain_through_the_parent():
    hash_block = BlockHasher().hash_block
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) and len(a) == 32
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])


def test_hits_sharing_and_lru_eviction():
    kv = KVCacheManager(num_pages=6, page_size=4)
    first = book_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, first) == 0
    second = book_request("b", [*range(8), 77, 78, 79])  # same first 2 blocks
    assert admit(kv, second) == 8
    shared = kv.get_block_table("a")[0][:2]
    assert kv.get_block_table("b")[0][:2] == shared
    assert all(kv.ref_counts[b] == 2 for b in shared)
    # A prompt that is exactly cached still computes its last token.
    third = book_request("c", list(range(8)))
    assert admit(kv, third) == 4
    for r in (first, second, third):
        kv.free(r)
    kv.check_invariants()
    assert kv.num_free_blocks == 6 and len(kv.cached) == 2  # freed, but still cached
    # A new request revives the cached blocks from the free queue.
    fourth = book_request("d", [*range(8), 5])
    assert admit(kv, fourth) == 8
    kv.free(fourth)
    # Filling the pool with unrelated blocks evicts the cached ones.
    big = book_request("e", list(range(100, 124)))  # 6 blocks: the whole pool
    assert admit(kv, big) == 0
    assert not kv.cached or all(b in kv.get_block_table("e")[0] for b in kv.cached.values())
    kv.free(big)
    assert admit(kv, book_request("f", [*range(8), 5])) == 0  # the old prefix was evicted


def test_reset_prefix_cache():
    kv = KVCacheManager(num_pages=4, page_size=4)
    req = book_request("a", list(range(9)))
    admit(kv, req)
    assert kv.reset_prefix_cache() is False  # blocks in use
    kv.free(req)
    assert kv.reset_prefix_cache() is True
    assert not kv.cached
    kv.check_invariants()
    assert admit(kv, book_request("b", list(range(9)))) == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_pages=3, page_size=4)
    admit(kv, book_request("a", list(range(8))))
    req = book_request("b", list(range(100, 120)))
    before = (list(kv.free_queue), dict(kv.block_tables))
    assert not kv.allocate_slots(req, 20)
    assert (list(kv.free_queue), dict(kv.block_tables)) == before
    kv.check_invariants()


@pytest.fixture(scope="module")
def long_llm(tiny_model_dir):
    return LLM(
        tiny_model_dir,
        max_model_len=1100,
        num_pages=200,
        max_num_seqs=4,
        max_num_batched_tokens=256,
    )


@contextlib.contextmanager
def _counting_tokens(llm):
    """Yields a list that collects the length of every chunk the runner computes."""
    runner, computed = llm.runner, []
    launch = runner.launch  # every step goes through it, with async scheduling or not

    def counting_launch(out):
        computed.extend(r.num_scheduled_tokens for r in out.requests)
        return launch(out)

    runner.launch = counting_launch
    try:
        yield computed
    finally:
        runner.launch = launch


def test_shared_1000_token_prefix_computes_only_new_tokens(long_llm, tiny_model_dir):
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 300, size=1000).tolist()
    first = prefix + rng.integers(3, 300, size=20).tolist()
    second = prefix + rng.integers(3, 300, size=30).tolist()
    long_llm.generate({"prompt_token_ids": first}, GREEDY, use_tqdm=False)

    kv = long_llm.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    with _counting_tokens(long_llm) as computed:
        out = long_llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    cached = (1000 // 16) * 16  # the full blocks of the shared prefix
    assert kv.prefix_cache_hits - hits_before == cached
    # Its prompt minus the cached blocks, then one token per decode step after the first.
    assert sum(computed) == len(second) - cached + GREEDY.max_tokens - 1

    fresh = LLM(
        tiny_model_dir,
        max_model_len=1100,
        num_pages=200,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        skip_warmup=True,
    )
    ref = fresh.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert fresh.kv_cache_manager.prefix_cache_hits == 0


def test_n_completions_share_the_prompt(long_llm):
    """Fan-out: the siblings of an n > 1 request wait for the first one to compute the prompt
    and start from its cached blocks, so the prompt is computed once, not n times."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 300, size=600).tolist()
    kv = long_llm.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=3)
    with _counting_tokens(long_llm) as computed:
        out = long_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    cached = (600 // 16) * 16
    assert kv.prefix_cache_hits - hits_before == 2 * cached
    # One full prompt, then each sibling only its uncached tail; one token per later step.
    assert sum(computed) == 600 + 2 * (600 - cached) + 3 * (params.max_tokens - 1)
    single = long_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    kv.check_invariants()


def test_a_cache_salt_isolates_prefixes(tiny_llm):
    """vLLM's `cache_salt` in a prompt dict: a prompt shares cached prefixes only with prompts
    of its salt."""
    kv = tiny_llm.kv_cache_manager
    ids = [7 + i % 50 for i in range(64)]

    def hits(salt):
        before = kv.prefix_cache_hits
        prompt = {"prompt_token_ids": ids} | ({} if salt is None else {"cache_salt": salt})
        tiny_llm.generate([prompt], GREEDY, use_tqdm=False)
        return kv.prefix_cache_hits - before

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0 and hits(None) == 0
    assert hits("tenant-a") == 48  # its own salt's 3 blocks of 16 (the last token computed)
    with pytest.raises(ValueError, match="cache_salt"):
        tiny_llm.generate([{"prompt_token_ids": ids, "cache_salt": ""}], GREEDY, use_tqdm=False)
