"""The hybrid KV cache (`jaxllm.worker.kv_groups`): layers grouped by window, one block table per
group over one pool, sliding groups freeing the blocks behind their window, prefix-cache hits
that need only the window's blocks there; and Gemma 3 served with it, token for token as
without it and as transformers."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.engine.host_blocks import HostBlockPool
from jaxllm.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.worker.kv_groups import KVCacheGroups, kv_cache_groups
from jaxllm.worker.kv_sizing import pages_per_sequence

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _config(num_layers: int, period: int | None, window: int | None = 512) -> ModelConfig:
    """Gemma 3's layout: every `period`-th layer full, the others sliding (None: all slide)."""
    types = ()
    if period is not None:
        types = tuple(
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
        sliding_window=window,
        layer_types=types,
    )


def test_gemma3_270m_groups_are_six_of_three():
    groups = kv_cache_groups(_config(18, 6))
    assert groups.windows == (None,) + (512,) * 5
    assert groups.layers[0] == (5, 11, 17)
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.num_slots == 3
    slots = groups.layer_slots
    assert slots[5] == ((0, 0),) and slots[17] == ((0, 2),) and slots[6] == ((2, 2),)
    # Every (group, slot) serves one layer.
    assert len(set(slots)) == 18


def test_uneven_kinds_pad_the_last_group():
    groups = kv_cache_groups(_config(26, 6))  # Gemma 3 1B: 4 full, 22 sliding
    assert groups.num_slots == 4 and groups.num_groups == 1 + 6
    assert [len(layers) for layers in groups.layers] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(layer for g in groups.layers for layer in g) == list(range(26))


def test_one_kind_is_one_group_and_hybrid_can_be_turned_off():
    assert kv_cache_groups(_config(4, None)) == KVCacheGroups((512,), ((0, 1, 2, 3),))
    assert kv_cache_groups(_config(4, None, window=None)) == KVCacheGroups.single(4)
    assert kv_cache_groups(_config(18, 6), hybrid=False) == KVCacheGroups.single(18)


def test_llama4_chunked_layers_keep_a_window_of_their_chunk():
    """Llama 4 Scout's layout (three chunked layers of 8,192 tokens, then a full one without
    RoPE): the chunked layers group as sliding ones with a window of the chunk."""
    import dataclasses

    types = tuple("full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(48))
    config = dataclasses.replace(
        _config(48, None, window=None), layer_types=types, attention_chunk_size=8192
    )
    groups = kv_cache_groups(config)
    assert groups.windows == (None,) + (8192,) * 3
    assert groups.layers[0] == tuple(range(3, 48, 4)) and groups.num_slots == 12
    assert [config.layer_window(i) for i in range(4)] == [None] * 4  # the mask is the chunk's


def test_gemma4_31b_layers_pack_into_one_row_shape_and_shared_layers_keep_no_pages():
    """Gemma 4 31B: 50 sliding layers of 16 kv heads of 256 (two to a 512-wide row: 8 rows,
    two slots of 4) and 10 full layers of 4 of 512 (one slot). The cache holds exactly their
    bytes; with E2B's sharing, the layers reading an earlier layer's KV keep none."""
    import json
    from pathlib import Path

    import jax.numpy as jnp

    from jaxllm.worker.kv_sizing import bytes_per_page

    root = Path(__file__).resolve().parents[1]
    hf = json.loads((root / "benchmarks/configs/gemma-4-31b/config.json").read_text())
    config = ModelConfig.from_hf_config(hf)
    assert (config.cache_kv_heads, config.cache_head_dim) == (4, 512)
    assert [config.layer_kv_parts(i) for i in (0, 5)] == [2, 1]
    groups = kv_cache_groups(config)
    assert groups.windows == (None,) + (1024,) * 10 and groups.num_slots == 10
    assert groups.layer_slots[0] == ((1, 0), (1, 1)) and len(groups.layer_slots[5]) == 1
    # Per token: 50 x 16 x 256 + 10 x 4 x 512 keys, as many values, 2 bytes each.
    exact = 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)
    page = bytes_per_page(config, 1, jnp.bfloat16, None, groups.num_slots)
    assert groups.num_groups * page == exact

    text = hf["text_config"] | {"num_kv_shared_layers": 20, "num_hidden_layers": 60}
    shared = ModelConfig.from_hf_config(hf | {"text_config": text})
    assert shared.kv_layers == tuple(range(40))
    assert [shared.layer_kv_source(i) for i in (40, 41, 46, 59)] == [39, 35, 39, 35]
    units = [layer for g in kv_cache_groups(shared).layers for layer in g]
    assert set(units) == set(range(40))  # the last 20 layers hold no slot


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, GREEDY, eos_token_ids=(), max_tokens=8, seed=0)


def _run(kv: KVCacheManager, req: Request, chunk: int, *, confirm: bool = True) -> int:
    """Admits `req` and computes its prompt in chunks as the scheduler would; returns the
    tokens its prefix-cache hit covered."""
    hit, cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = cached
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n, hit)
        hit = None
        req.num_computed_tokens += n
        if confirm:
            kv.cache_full_blocks(req)
        kv.check_invariants()
    return cached


def test_a_sliding_group_frees_the_blocks_behind_its_window():
    page, window, chunk = 4, 10, 6
    kv = KVCacheManager(64, page, windows=(None, window))
    req = _request("a", list(range(40)))
    _run(kv, req, chunk)
    kv.allocate_slots(req, 1)  # the first decode step
    full, sliding = kv.get_block_table("a")
    assert NULL_BLOCK not in full and len(full) == len(sliding) == 11
    # The next token (position 40) sees keys 31..40: blocks 7 on.
    assert sliding[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in sliding[7:]
    groups = KVCacheGroups((None, window), ((0,), (1,)))
    assert kv.num_live_blocks("a") <= pages_per_sequence(groups, 41, page, chunk)
    kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == 64


def test_a_hit_needs_every_full_block_and_only_the_windows_blocks():
    page, window = 4, 6
    kv = KVCacheManager(64, page, windows=(None, window))
    prompt = list(range(1, 34))  # 8 full blocks + 1 token
    a = _request("a", prompt)
    _run(kv, a, chunk=4)
    kv.free(a)
    b = _request("b", prompt + [99])
    hit, cached = kv.get_computed_blocks(b)
    assert cached == 32
    # Position 32 sees keys 27..32: the sliding group needs blocks 6 and 7 only.
    assert [e is None for e in hit.entries[1]] == [True] * 6 + [False] * 2
    assert all(e is not None for e in hit.entries[0])
    b.num_computed_tokens = cached
    assert kv.allocate_slots(b, b.num_tokens - cached, hit)
    kv.check_invariants()
    assert kv.get_block_table("b")[1][:6] == [NULL_BLOCK] * 6


def test_a_hit_shrinks_until_every_sliding_group_has_its_window():
    page, window = 4, 6
    kv = KVCacheManager(64, page, windows=(None, window))
    prompt = list(range(1, 34))
    a = _request("a", prompt)
    _run(kv, a, chunk=4)
    kv.free(a)
    # Forget the sliding group's block 7: a hit at 32 tokens loses the window it needs there.
    key = (1, kv._block_hashes(a)[7])
    block = kv.cached.pop(key)
    kv.block_keys[block] = None
    hit, cached = kv.get_computed_blocks(_request("b", prompt + [99]))
    # At 28 tokens the window (keys 23..28) needs blocks 5 and 6 only, which are cached.
    assert cached == 28
    assert [e is None for e in hit.entries[1]] == [True] * 5 + [False] * 2

    # Async scheduling: the step after a prefill is scheduled before the prefill's blocks
    # are keyed. It keeps them (a later hit needs the window before its own end), and frees
    # them the step after.
    c = _request("c", list(range(500, 533)))
    _run(kv, c, chunk=33, confirm=False)
    c.append_output_token(7)
    assert kv.allocate_slots(c, 1)
    assert NULL_BLOCK not in kv.get_block_table("c")[1]
    kv.cache_full_blocks(c)  # the prefill's output arrives
    c.num_computed_tokens += 1
    assert kv.allocate_slots(c, 1)
    assert kv.get_block_table("c")[1][:7] == [NULL_BLOCK] * 7
    kv.free(c)
    hit, cached = kv.get_computed_blocks(_request("d", list(range(500, 533)) + [1]))
    assert cached == 32 and [e is None for e in hit.entries[1]] == [True] * 6 + [False] * 2
    hit, cached = kv.get_computed_blocks(_request("e", list(range(500, 520)) + [1, 2, 3]))
    assert cached == 20 and [e is None for e in hit.entries[1]] == [True] * 3 + [False] * 2


def test_preemption_and_resumption_keep_the_books():
    rng = np.random.default_rng(0)
    kv = KVCacheManager(40, 4, windows=(None, 7, 7))
    live: dict[str, Request] = {}
    for step in range(400):
        if live and rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            kv.free(live.pop(rid))
        else:
            rid = f"r{step}"
            shared = list(range(int(rng.integers(0, 20))))
            req = _request(rid, shared + rng.integers(100, 200, int(rng.integers(1, 30))).tolist())
            hit, cached = kv.get_computed_blocks(req)
            req.num_computed_tokens = cached
            if kv.allocate_slots(req, req.num_tokens - cached, hit):
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live[rid] = req
                for _ in range(int(rng.integers(0, 6))):  # a few decode steps
                    req.append_output_token(7)
                    if not kv.allocate_slots(req, 1):
                        break
                    req.num_computed_tokens += 1
                    kv.cache_full_blocks(req)
        kv.check_invariants()
    for req in live.values():
        kv.free(req)
    kv.check_invariants()
    assert kv.num_free_blocks == 40


def test_host_tier_keeps_each_groups_blocks():
    page, window = 4, 6
    kv = KVCacheManager(12, page, windows=(None, window), host=HostBlockPool(32))
    prompt = list(range(1, 18))  # 4 full blocks + 1
    a = _request("a", prompt)
    _run(kv, a, chunk=17)
    kv.free(a)
    _run(kv, other := _request("x", list(range(100, 121))), chunk=21)  # evicts a's blocks
    kv.free(other)
    kv.take_transfers()
    b = _request("b", prompt + [5])
    hit, cached = kv.get_computed_blocks(b)
    assert cached == 16
    b.num_computed_tokens = cached
    assert kv.allocate_slots(b, b.num_tokens - cached, hit)
    _, loads = kv.take_transfers()
    full, sliding = kv.get_block_table("b")
    # Every block of the full group, and the window's two of the sliding group, copied back.
    assert {block for _, block in loads} == set(full[:4]) | set(sliding[2:4])
    assert sliding[:2] == [NULL_BLOCK] * 2
    kv.check_invariants()


def test_pages_per_sequence_counts_the_window_and_a_step():
    groups = kv_cache_groups(_config(18, 6))
    # Full group: 2048 blocks at 32k; each sliding group: 511 + 2 x 512 tokens -> 96 + 1.
    assert pages_per_sequence(groups, 32768, 16, 512) == 2048 + 5 * 97
    assert pages_per_sequence(groups, 100, 16, 512) == 6 * 7
    assert pages_per_sequence(groups, 32768, 16) == 6 * 2048


def test_twice_the_requests_fit_at_8k_in_the_same_memory():
    """Gemma 3 270M's layout (18 layers, 3 full, window 512): the sequences of 8k tokens the
    same bytes hold, through the manager's own bookkeeping, against one group of every layer."""
    config, page, chunk = _config(18, 6), 16, 512
    budget_layer_pages = 18 * 4096  # the same memory, counted in pages of one layer

    def fits(groups: KVCacheGroups) -> int:
        kv = KVCacheManager(budget_layer_pages // groups.num_slots, page, windows=groups.windows)
        n = 0
        while True:
            req = _request(f"r{n}", list(range(8191)))
            ok = True
            while ok and req.num_computed_tokens < req.num_tokens:
                step = min(chunk, req.num_tokens - req.num_computed_tokens)
                ok = kv.allocate_slots(req, step)
                # Async scheduling: a step's blocks are keyed when the next is scheduled.
                req.num_computed_tokens += step
                req.num_inflight_tokens = step
                kv.cache_full_blocks(req)
            if not ok or not kv.allocate_slots(req, 1):
                return n
            n += 1

    hybrid, single = fits(kv_cache_groups(config)), fits(KVCacheGroups.single(18))
    print(f"8k sequences in the same memory: {hybrid} hybrid, {single} one group")
    assert single == 4096 // 512 and hybrid >= 2 * single


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    pytest.importorskip("torch")
    from helpers import write_family_checkpoint

    path = tmp_path_factory.mktemp("gemma3")
    return path, write_family_checkpoint("gemma3", path)


def test_gemma3_greedy_tokens_are_the_same_with_and_without_the_hybrid_cache(gemma3):
    """A workload past the window with preemptions (a small pool), chunked prefill and prefix
    hits: the same greedy tokens with the hybrid manager as with one group of every layer,
    and the hybrid engine's requests hold fewer blocks."""
    from helpers import VOCAB, WINDOW

    path, _ = gemma3
    rng = np.random.default_rng(3)
    shared = rng.integers(3, VOCAB, size=2 * WINDOW).tolist()
    prompts = [
        shared + rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(1, 40, 10)
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs, peaks = [], []
    for disable in (False, True):
        llm = LLM(
            path,
            dtype="float32",
            page_size=8,
            # Both preempt: a sequence takes up to 56 pages of 1 slot (hybrid) or 20 of 4.
            num_pages=24 if disable else 56,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            max_model_len=160,
            skip_warmup=True,
            disable_hybrid_kv_cache_manager=disable,
        )
        groups = llm.runner.kv_groups
        assert groups.num_groups == (1 if disable else 4)
        kv = llm.kv_cache_manager
        peak = 0
        original = kv.allocate_slots

        def allocate(request, *args, _kv=kv, _original=original, _slots=groups.num_slots, **kw):
            nonlocal peak
            ok = _original(request, *args, **kw)
            # A request's blocks, in pages of one layer.
            peak = max(peak, _kv.num_live_blocks(request.request_id) * _slots)
            _kv.check_invariants()
            return ok

        kv.allocate_slots = allocate
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        peaks.append(peak)
        assert kv.num_free_blocks == kv.num_pages
        assert kv.prefix_cache_hits >= 2 * WINDOW and llm.engine.scheduler.num_preemptions
    assert outs[0] == outs[1]
    print(f"one request's peak, in pages of one layer: {peaks[0]} hybrid, {peaks[1]} not")
    assert peaks[0] < 0.75 * peaks[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [(), ("--kv-offloading-size", "0.01", "--kv-cache-dtype", "int8")], ids=["", "host"]
)
def test_gemma3_hybrid_cache_under_tensor_parallelism(gemma3, tmp_path, extra):
    """TP 2 (8 fake CPU devices, in a subprocess): the same greedy tokens as TP 1 with the
    hybrid cache, each device holding half of every group's pages, nothing compiled after
    warmup; with the host tier and an 8-bit cache, prompts evicted by others come back from
    host memory with the same tokens."""
    from helpers import tensor_parallel_report

    path, _ = gemma3
    rows = tensor_parallel_report(path, "1,2", tmp_path, *extra)
    assert [r["tp"] for r in rows] == [1, 2]
    for row in rows:
        assert row["same_tokens_as_first"] and row["compiled_after_warmup"] == 0, row
        assert all(row["same_tokens_after_sleep"]), row
        if extra:
            assert row["host_tier"]["same_tokens"] and row["host_tier"]["hit_tokens"] > 0, row
    assert rows[1]["kv_bytes_per_device"] * 2 == rows[1]["kv_bytes"] == rows[0]["kv_bytes"]


def test_gemma3_ngram_speculation_with_the_hybrid_cache(gemma3):
    """Rejected drafts roll a request back, never behind a block its sliding groups freed:
    with n-gram speculation, preemptions and prefix hits, the same greedy tokens as without."""
    from helpers import VOCAB

    path, _ = gemma3
    rng = np.random.default_rng(5)
    base = rng.integers(3, VOCAB, 30).tolist()
    prompts = [
        (base * 4)[: int(n)] + rng.integers(3, VOCAB, 5).tolist() for n in rng.integers(20, 110, 8)
    ]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = []
    for spec in (
        None,
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False},
    ):
        llm = LLM(
            path,
            dtype="float32",
            page_size=8,
            num_pages=80,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=192,
            speculative_config=spec,
            skip_warmup=True,
        )
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        kv = llm.kv_cache_manager
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_pages and llm.engine.scheduler.num_preemptions
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0
    assert outs[0] == outs[1]
