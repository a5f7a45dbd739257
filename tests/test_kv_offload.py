"""The prefix cache's host-RAM tier (`kv_offloading_size`): blocks evicted from the device
pool are copied to host memory and back on a hit. The books (`HostBlockPool` inside the
`KVCacheManager`), then engines whose returning conversations do not fit the device pool: the
same tokens as without any prefix cache, hits served from the host, nothing compiled after
warmup, the host's memory bounded; under tensor parallelism too."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.host_blocks import HostBlockPool
from jaxllm.engine.kv_cache_manager import KVCacheManager
from tests.helpers import admit, book_request, tensor_parallel_report

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_evicted_blocks_go_to_the_host_and_come_back():
    kv = KVCacheManager(num_pages=4, page_size=4, host=HostBlockPool(8))
    a = book_request("a", list(range(9)))  # 2 full blocks + 1 token
    assert admit(kv, a) == 0
    kv.free(a)
    assert kv.take_transfers() == ([], [])
    b = book_request("b", list(range(100, 116)))  # 4 blocks: evicts a's two cached ones
    admit(kv, b)
    stores, loads = kv.take_transfers()
    assert len(stores) == 2 and not loads and len(kv.host) == 2
    kv.free(b)
    # `a` again: its two blocks miss on the device and hit in the host tier, into fresh
    # device blocks that are keyed at once (b's evicted ones go to the host meanwhile).
    again = book_request("a2", list(range(9)))
    assert admit(kv, again) == 8
    stores, loads = kv.take_transfers()
    table = kv.get_block_table("a2")[0]
    assert [block for _, block in loads] == table[:2]
    assert sorted(slot for slot, _ in loads) == [0, 1] and len(stores) == 3
    assert all(kv.block_keys[b] is not None for b in table[:2])
    assert kv.host.num_loaded == 2 and kv.host.hit_tokens == 8
    # The device now holds them: a third request hits there, with no copy.
    third = book_request("a3", [*range(8), 50])
    assert admit(kv, third) == 8
    assert kv.take_transfers()[1] == []


def test_a_block_loaded_and_evicted_in_one_step_is_neither_loaded_nor_stored():
    kv = KVCacheManager(num_pages=2, page_size=4, host=HostBlockPool(4))
    a = book_request("a", list(range(5)))
    admit(kv, a)
    kv.free(a)
    admit(kv, b := book_request("b", list(range(20, 28))))  # evicts a's block to the host
    kv.free(b)
    kv.take_transfers()
    hit = book_request("c", list(range(5)))
    assert admit(kv, hit) == 4
    kv.free(hit)  # preempted within the same step: its blocks are free again
    admit(kv, book_request("d", list(range(40, 48))))  # takes both, the loaded one too
    stores, loads = kv.take_transfers()
    loaded_block = kv.get_block_table("d")[0]
    assert loads == [], "a load into a block taken over in the same step"
    assert all(block in loaded_block for block, _ in stores)
    assert len(stores) == 2  # b's two blocks, evicted for c: gathered before d writes them


def test_the_host_tier_is_bounded_and_least_recently_used_goes_first():
    pool = HostBlockPool(2)
    slots = [pool.store(k) for k in (b"a", b"b")]
    assert sorted(slots) == [0, 1]
    assert pool.lookup(b"a") == slots[0]  # a is now the most recent
    assert pool.store(b"c") == slots[1] and b"b" not in pool and len(pool) == 2
    pool.clear()
    assert len(pool) == 0 and pool.store(b"d") in (0, 1)


def test_reset_prefix_cache_forgets_the_host_tier():
    kv = KVCacheManager(num_pages=2, page_size=4, host=HostBlockPool(4))
    admit(kv, a := book_request("a", list(range(5))))
    kv.free(a)
    admit(kv, b := book_request("b", list(range(20, 28))))
    kv.free(b)
    assert len(kv.host) == 1 and kv.reset_prefix_cache() and len(kv.host) == 0


def _conversations(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 200, size=length).tolist() for _ in range(n)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_returning_conversations_larger_than_the_pool(tiny_model_dir, kv_cache_dtype):
    """Eight 150-token conversations, three rounds each, through a pool of 24 pages (384
    tokens): without the tier every return recomputes; with it, the returns hit in host
    memory. Same tokens as an engine without prefix caching, nothing compiled after warmup,
    and the host's copies within `kv_offloading_size`."""
    convs = _conversations(8, 150)
    common = dict(
        max_model_len=256,
        num_pages=24,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_dtype=kv_cache_dtype,
    )

    def run(llm) -> list[list[int]]:
        return [
            llm.generate({"prompt_token_ids": c}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(3)
            for c in convs
        ]

    expected = run(LLM(tiny_model_dir, enable_prefix_caching=False, skip_warmup=True, **common))
    size = 0.004  # GiB: 4 MiB
    llm = LLM(tiny_model_dir, kv_offloading_size=size, **common)
    before = llm.runner.num_compilations
    assert run(llm) == expected
    assert llm.runner.num_compilations == before, "compiled after warmup"
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits_host > 0 and stats.kv_offload_loaded > 0
    assert stats.kv_offload_stored >= stats.kv_offload_blocks > 0
    assert llm.runner.offloader.host_bytes <= size * 2**30


def test_bad_sizes_name_the_parameter(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_offloading_size must be >= 0"):
        LLM(tiny_model_dir, kv_offloading_size=-1, skip_warmup=True)
    with pytest.raises(ValueError, match="kv_offloading_size needs prefix caching"):
        LLM(tiny_model_dir, kv_offloading_size=1, enable_prefix_caching=False, skip_warmup=True)
    with pytest.raises(
        ValueError, match="kv_offloading_size: a host tier of 1e-09 GiB holds no block"
    ):
        LLM(tiny_model_dir, kv_offloading_size=1e-9, num_pages=8, skip_warmup=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tensor_parallel_host_tier(tiny_model_dir, tmp_path, kv_cache_dtype):
    """Each device's shard of a block (and of an 8-bit cache's scales) goes to the host and
    comes back: the same tokens at TP 1 and 2, the prompts answered again from host memory
    after other prompts evicted them."""
    extra = ("--kv-offloading-size", "0.01", "--kv-cache-dtype", kv_cache_dtype)
    rows = tensor_parallel_report(tiny_model_dir, "1,2", tmp_path, *extra)
    for row in rows:
        assert row["same_tokens_as_first"], row["tp"]
        assert row["host_tier"]["same_tokens"] and row["host_tier"]["hit_tokens"] > 0, row
        assert row["compiled_after_warmup"] == 0, row


def test_the_host_tier_outlives_sleep(tiny_model_dir):
    """Sleep drops the device's cache and its prefixes; the host tier's copies stay, and a
    returning conversation after waking is served from them, with the same tokens."""
    convs = _conversations(6, 150, seed=1)
    llm = LLM(tiny_model_dir, max_model_len=256, num_pages=24, max_num_seqs=4,
              max_num_batched_tokens=64, kv_offloading_size=0.004)  # fmt: skip

    def run():
        outs = [llm.generate({"prompt_token_ids": c}, GREEDY, use_tqdm=False) for c in convs]
        return [o[0].outputs[0].token_ids for o in outs]

    first = run()  # the early conversations' blocks are evicted to the host by the later ones
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        hits = llm.engine.stats().prefix_cache_hits_host
        assert run() == first, level
        assert llm.engine.stats().prefix_cache_hits_host > hits, level
