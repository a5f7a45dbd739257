"""The scheduler alone, on a KV pool without a model: who runs, who is preempted."""

from __future__ import annotations

import itertools

from jaxllm.config import SchedulerConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import RunnerOutput

PAGE = 4


def make_scheduler(num_pages: int, *, policy: str = "priority", max_num_seqs: int = 8):
    from jaxllm.engine.scheduler import Scheduler

    config = SchedulerConfig(
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        scheduling_policy=policy,
    )
    return Scheduler(config, KVCacheManager(num_pages, PAGE, enable_prefix_caching=False))


_ids = itertools.count()


def add(scheduler, num_prompt_tokens: int, priority: int) -> Request:
    request = Request(
        f"r{next(_ids)}",
        list(range(1, num_prompt_tokens + 1)),
        SamplingParams(max_tokens=100, ignore_eos=True),
        eos_token_ids=(),
        max_tokens=100,
        seed=0,
        priority=priority,
    )
    scheduler.add_request(request)
    return request


def step(scheduler) -> list[str]:
    """One step; every request that reached the end of its sequence samples token 7."""
    out = scheduler.schedule()
    sampled = {
        s.request_id: [7]
        for s in out.requests
        if s.num_computed_tokens + s.num_scheduled_tokens
        == scheduler.requests[s.request_id].num_tokens
    }
    scheduler.update_from_output(out, RunnerOutput(sampled, {}, {}))
    scheduler.kv.check_invariants()
    return [s.request_id for s in out.requests]


def test_priority_victim_is_lowest_priority_even_if_already_scheduled():
    # The low-priority request started first, so each step grants it first. When the pool is
    # dry and the high-priority one needs a block, the victim is the low-priority request
    # (its grant taken back), not the high-priority request asking.
    s = make_scheduler(num_pages=3)
    low = add(s, PAGE + 1, priority=5)  # 2 pages, room for 2 more tokens after this step
    assert step(s) == [low.request_id]
    high = add(s, PAGE, priority=0)  # 1 page, full after its prefill
    assert step(s) == [low.request_id, high.request_id]
    assert s.kv.num_free_blocks == 0
    # low's next token fits its second page; high's needs a new page.
    assert step(s) == [high.request_id]
    assert high.status == RequestStatus.RUNNING and high.num_output_tokens == 2
    assert low.status == RequestStatus.PREEMPTED
    assert s.num_preemptions == 1


def test_fcfs_victim_is_newest_not_yet_scheduled():
    s = make_scheduler(num_pages=4, policy="fcfs")
    first = add(s, PAGE, priority=5)
    second = add(s, PAGE, priority=0)
    for _ in range(PAGE + 2):  # the sixth step needs a third page each, with 4 in the pool
        step(s)
    assert first.status == RequestStatus.RUNNING
    assert second.status == RequestStatus.PREEMPTED


def test_waiting_high_priority_preempts_running_low_priority_for_a_seat():
    s = make_scheduler(num_pages=64, max_num_seqs=1)
    low = add(s, PAGE, priority=5)
    step(s)
    high = add(s, PAGE, priority=0)
    assert step(s) == [high.request_id]
    assert low.status == RequestStatus.PREEMPTED
    # Equal priority does not preempt: a newcomer waits for the seat.
    same = add(s, PAGE, priority=0)
    assert step(s) == [high.request_id]
    assert same.status == RequestStatus.WAITING


def test_waiting_high_priority_preempts_running_low_priority_for_blocks():
    s = make_scheduler(num_pages=3)
    low = add(s, 2 * PAGE, priority=5)  # 2 pages, and a third at its first decode
    step(s)
    step(s)
    assert low.num_output_tokens == 2 and s.kv.num_free_blocks == 0
    high = add(s, PAGE, priority=0)
    assert step(s) == [high.request_id]
    assert low.status == RequestStatus.PREEMPTED
    # The preempted one comes back once the high-priority request is done with the pool.
    s.abort_requests([high.request_id])
    assert step(s) == [low.request_id]
    assert low.status == RequestStatus.RUNNING


def test_fcfs_waiting_request_never_preempts():
    s = make_scheduler(num_pages=64, max_num_seqs=1, policy="fcfs")
    first = add(s, PAGE, priority=5)
    step(s)
    add(s, PAGE, priority=0)
    assert step(s) == [first.request_id]


def test_full_request_data_crosses_once():
    s = make_scheduler(num_pages=64, policy="fcfs")
    a, b = add(s, PAGE, priority=0), add(s, 2, priority=0)
    first = s.schedule()
    assert [n.request_id for n in first.new_requests] == [a.request_id, b.request_id]
    assert first.new_requests[0].token_ids == a.prompt_token_ids
    assert [r.new_block_ids for r in first.requests] == [[[]], [[]]]  # whole tables sent as new
    s.update_from_output(first, RunnerOutput({a.request_id: [7], b.request_id: [7]}, {}, {}))
    second = s.schedule()
    assert second.new_requests == []
    # a's fifth token starts its second page: only that block crosses; b's fits its first.
    assert [r.new_block_ids for r in second.requests] == [
        [s.kv.get_block_table(a.request_id)[0][1:]],
        [[]],
    ]
    assert [(r.num_computed_tokens, r.num_scheduled_tokens) for r in second.requests] == [
        (PAGE, 1),
        (2, 1),
    ]


def test_resumed_request_crosses_again_with_its_tokens():
    s = make_scheduler(num_pages=4, policy="fcfs")
    first, second = add(s, PAGE, priority=0), add(s, PAGE, priority=0)
    for _ in range(PAGE + 2):  # the sixth step preempts `second` (see the fcfs test)
        out = s.schedule()
        sampled = {
            r.request_id: [7]
            for r in out.requests
            if r.num_computed_tokens + r.num_scheduled_tokens == s.requests[r.request_id].num_tokens
        }
        s.update_from_output(out, RunnerOutput(sampled, {}, {}))
    assert out.preempted_request_ids == [second.request_id]
    s.abort_requests([first.request_id])
    out = s.schedule()
    assert out.finished_request_ids == [first.request_id]
    (new,) = out.new_requests
    assert new.request_id == second.request_id
    assert new.token_ids == second.prompt_token_ids + [7] * second.num_output_tokens
    assert new.block_ids == s.kv.get_block_table(second.request_id)
