"""A hybrid model's prefix cache on the host, without a model: the saved-state pool (pending
until the step that saves has run, least recently used reuse, a decode's saves replacing each
other), hits cut to a saved state, and the scheduler's chunks cut at page boundaries."""

from __future__ import annotations

import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.state_snapshots import StateSnapshots
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import RunnerOutput

PAGE = 4


def _request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, eos_token_ids=(), max_tokens=max_tokens, seed=0)


def _scheduler(snapshots: int, *, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget)
    kv = KVCacheManager(64, PAGE, snapshots=StateSnapshots(snapshots))
    return Scheduler(config, kv)


def _step(scheduler: Scheduler, *, token: int = 7):
    """One step, run: every request that reached the end of its sequence samples `token`."""
    out = scheduler.schedule()
    sampled = {
        s.request_id: [token]
        for s in out.requests
        if s.num_computed_tokens + s.num_scheduled_tokens
        == scheduler.requests[s.request_id].num_tokens
    }
    scheduler.update_from_output(out, RunnerOutput(sampled, {}, {}))
    scheduler.kv.check_invariants()
    return out


def test_the_pool_keys_a_save_only_once_its_step_ran_and_reuses_the_oldest():
    """A save is found once its step ran; its slot is held until the request's next chunk
    (which reads its state from there) is scheduled; then slots go least recently used
    first."""
    pool = StateSnapshots(2)
    a = pool.take("r", 8)
    assert pool.find(b"a") is None and pool.num_pending == 1  # in flight: not found
    pool.commit("r", a, b"a", decoding=False)
    assert pool.find(b"a") == a and a not in pool.free  # r's state is still there
    assert pool.leave("r") == a and a in pool.free
    assert pool.leave("r") == -1  # its state is back in its own slot
    b = pool.take("r", 16)
    assert pool.leave("r") == b and b not in pool.free  # read before its save was committed
    pool.commit("r", b, b"b", decoding=False)
    assert b in pool.free
    pool.use(a)  # a hit: `a` is now the most recently used
    c = pool.take("s", 4)
    assert c == b and pool.find(b"b") is None and pool.find(b"a") == a
    pool.release("s")  # preempted before its step's output: nothing keyed
    pool.commit("s", c, b"c", decoding=False)
    assert pool.find(b"c") is None and c in pool.free
    pool.check_invariants()
    with pytest.raises(ValueError, match="num_state_snapshots"):
        StateSnapshots(0)


def test_a_decodes_saves_replace_each_other_and_equal_states_are_kept_once():
    pool = StateSnapshots(4)

    def save(rid, boundary, key, decoding):
        slot = pool.take(rid, boundary)
        pool.commit(rid, slot, key, decoding=decoding)
        assert pool.leave(rid) == slot
        return slot

    prompt = save("r", 8, b"p", False)
    first = save("r", 12, b"d1", True)
    second = save("r", 16, b"d2", True)
    assert pool.find(b"d1") is None and pool.find(b"d2") == second
    assert pool.find(b"p") == prompt  # the prompt's save stays
    assert next(iter(pool.free)) == first  # the replaced slot is reused first
    dup = save("s", 8, b"p", False)  # computed twice: kept once
    assert pool.find(b"p") == prompt and pool.keys[dup] is None
    held = pool.take("t", 4)
    pool.release("t")  # finished with its last save committed or not: nothing held
    assert held in pool.free
    pool.clear()
    assert not pool.cached
    pool.check_invariants()


def test_hits_end_where_a_state_was_saved():
    """The attention blocks of 3 pages are cached, the state only after 1: the hit is one
    page, and says where its state is. Without any saved state, nothing is served."""
    kv = KVCacheManager(16, PAGE, snapshots=StateSnapshots(4))
    first = _request("a", list(range(13)))
    hit, n = kv.get_computed_blocks(first)
    assert (hit, n) == (None, 0)
    assert kv.allocate_slots(first, 13)
    first.num_computed_tokens = 13
    kv.cache_full_blocks(first)
    assert len(kv.cached) == 3
    again = _request("b", list(range(13)))
    assert kv.get_computed_blocks(again) == (None, 0)  # pages, but no state: recomputed
    slot = kv.save_state(first, 4)
    assert kv.save_state(first, 6) == -1  # not a boundary
    kv.commit_state(first, slot)
    assert kv.state_source(first) == slot  # its next chunk reads it
    hit, n = kv.get_computed_blocks(again)
    assert n == 4 and hit.state == slot
    assert kv.save_state(first, 4) == -1  # saved already
    kv.free(first)
    kv.check_invariants()


def test_prompt_chunks_end_at_page_boundaries_whose_next_chunk_saves():
    """A 23-token prompt under a 10-token budget: chunks 8, 8 and 4 tokens (the last ends at
    the prompt's last boundary, 20), then 3; the chunks ending at 8, 16 and 20 save the state
    after them, and the decodes that end at a boundary do too (the later replacing the
    earlier). A second request for the same prompt starts from the state at 20."""
    s = _scheduler(8, budget=10)
    first = _request("a", list(range(1, 24)), max_tokens=6)
    s.add_request(first)
    chunks, saves, slots = [], [], []
    while s.has_unfinished_requests():
        out = _step(s)
        for r in out.requests:
            chunks.append((r.num_computed_tokens, r.num_scheduled_tokens))
            slots.append((r.state_from, r.state_save))
            if r.state_save >= 0:
                saves.append(r.num_computed_tokens + r.num_scheduled_tokens)
    # A chunk that saves writes its state to the save slot; the next one reads it there.
    for (_, saved), (read, _) in zip(slots, slots[1:], strict=False):
        assert read == saved
    assert chunks[:4] == [(0, 8), (8, 8), (16, 4), (20, 3)]
    assert chunks[4:] == [(p, 1) for p in range(23, 28)]  # decodes: 23 + 6 tokens, last unfed
    assert saves == [8, 16, 20, 24, 28]
    assert len(s.kv.snapshots.cached) == 4 and not s.kv.snapshots.pending
    second = _request("b", list(range(1, 24)))
    s.add_request(second)
    out = _step(s)
    assert (out.requests[0].num_computed_tokens, out.requests[0].state_from) == (
        20,
        s.kv.snapshots.find(s.kv._block_hashes(second)[4]),
    )
    assert out.requests[0].state_save == -1  # ends off a boundary


def test_a_prompt_of_whole_pages_is_saved_a_page_before_its_end():
    """A 16-token prompt: chunks end at 12 (where the same prompt's hit ends: it must leave a
    token to compute) and 16; the same prompt again starts from the state at 12."""
    s = _scheduler(8)
    s.add_request(_request("a", list(range(1, 17)), max_tokens=1))
    chunks = [(r.num_computed_tokens, r.num_scheduled_tokens) for r in _step(s).requests]
    chunks += [(r.num_computed_tokens, r.num_scheduled_tokens) for r in _step(s).requests]
    assert chunks == [(0, 12), (12, 4)] and not s.has_unfinished_requests()
    s.add_request(_request("b", list(range(1, 17)), max_tokens=1))
    out = _step(s)
    assert out.requests[0].num_computed_tokens == 12 and out.requests[0].state_from >= 0
