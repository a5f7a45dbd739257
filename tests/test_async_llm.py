"""AsyncLLM with the engine core on a thread (in-process mode: the same loop and sockets as
the server's child process): concurrent streams, early exits that abort, stop strings."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from jaxllm import SamplingParams
from jaxllm.engine.async_llm import AsyncLLM, _Stream
from jaxllm.engine.messages import AddRequest
from jaxllm.errors import RequestFailedError

ENGINE = dict(max_model_len=256, num_pages=128, max_num_seqs=16, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def prompts():
    return [[5 + i, 17, 40 + 2 * i, 9] * (i + 1) for i in range(6)]


def test_concurrent_streams_match_the_offline_engine(tiny_model_dir, tiny_llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in tiny_llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )  # fmt: skip
    ]

    async def run():
        eng = await AsyncLLM.create(str(tiny_model_dir), in_process=True, **ENGINE)
        try:

            async def one(ids):
                snapshots = [o.outputs[0] async for o in eng.generate(ids, params)]
                # Snapshots growing (a token per step, or more when read late), each one a
                # prefix of the next, the last one finished.
                lengths = [len(s.token_ids) for s in snapshots]
                assert lengths == sorted(set(lengths)) and lengths[-1] == 10
                final = snapshots[-1]
                for s in snapshots:
                    assert final.token_ids[: len(s.token_ids)] == s.token_ids
                assert [s.finish_reason for s in snapshots[:-1]] == [None] * (len(lengths) - 1)
                assert final.finish_reason == "length"
                return final.token_ids

            got = await asyncio.gather(*(one(p) for p in prompts))

            # Issue 13, defect 7: a reader that stops reading costs one snapshot, not one per
            # token (they used to queue up, each holding the whole text so far).
            slow = eng.generate(prompts[3], SamplingParams(temperature=0, max_tokens=40,
                                                           ignore_eos=True))  # fmt: skip
            assert len((await anext(slow)).outputs[0].token_ids) == 1
            for _ in range(300):
                if eng.stats.num_running == eng.stats.num_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            rest = [o.outputs[0] async for o in slow]
            assert [len(o.token_ids) for o in rest] == [40] and rest[0].finish_reason == "length"

            # Leaving a stream early aborts its request: the engine ends idle.
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            async for out in eng.generate(prompts[0], long):
                if len(out.outputs[0].token_ids) == 3:
                    break
            for _ in range(50):
                stats = eng.stats
                if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.1)
            assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)
            assert eng.num_unfinished == 0

            # Bad prompts are refused before they reach the core.
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await anext(eng.generate([10**6], params))
            with pytest.raises(ValueError, match="stop_token_ids"):
                await anext(eng.generate(prompts[0], SamplingParams(stop_token_ids=[2**31])))

            # Issue 13, defect 8: a request id already in use is refused, and the other
            # request goes on (it used to kill the core process).
            stream = eng.generate(prompts[1], long, request_id="dup")
            first = await anext(stream)
            with pytest.raises(ValueError, match="already in use"):
                await anext(eng.generate(prompts[2], params, request_id="dup"))
            assert len((await anext(stream)).outputs[0].token_ids) == 2
            await stream.aclose()

            # What the front end would refuse, sent to the core anyway: only that request
            # fails, the core goes on serving.
            bad = AddRequest("bad", prompts[0], SamplingParams(stop_token_ids=[10**6]),
                             max_tokens=4, seed=0, eos_token_ids=[])  # fmt: skip
            eng._streams["bad"] = stream = _Stream()
            eng.client.add_request(bad)
            await asyncio.wait_for(stream.ready.wait(), 30)
            assert isinstance(stream.error, RequestFailedError)
            eng._streams.pop("bad")
            assert first.outputs[0].token_ids
            again = [o async for o in eng.generate(prompts[0], params)]
            assert again[-1].outputs[0].token_ids == got[0]
            return got
        finally:
            await eng.shutdown()

    assert asyncio.run(run()) == expected


def test_a_failure_in_output_processing_fails_every_request(tiny_model_dir, prompts):
    """Issue 13, defect 8: an exception while processing the core's outputs used to kill the
    output loop silently, leaving every request waiting forever."""
    from jaxllm.errors import EngineDeadError

    async def run():
        eng = await AsyncLLM.create(str(tiny_model_dir), in_process=True, **ENGINE)
        try:
            params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

            def broken(updates):
                raise RuntimeError("a bug")

            eng.output_processor.process = broken

            async def one(ids):
                return [o async for o in eng.generate(ids, params)]

            results = await asyncio.wait_for(
                asyncio.gather(*(one(p) for p in prompts[:3]), return_exceptions=True), 30
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert eng.dead
        finally:
            await eng.shutdown()

    asyncio.run(run())


def test_a_failing_step_fails_only_its_requests(tiny_model_dir, tiny_llm, prompts, monkeypatch):
    """Fault injection: a device step that raises fails the requests it held; the one waiting
    for a seat runs afterwards, with the tokens it gets alone, and the core keeps serving."""
    from jaxllm.engine.core import EngineCore

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = tiny_llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)
    step = EngineCore.step

    def faulty_step(self):
        if any(r.request_id == "faulty" for r in self.scheduler.running):
            raise RuntimeError("simulated device fault")
        return step(self)

    monkeypatch.setattr(EngineCore, "step", faulty_step)  # the core runs on a thread here

    async def run():
        engine = dict(ENGINE, max_num_seqs=1)  # one seat: "waiting" waits for it
        eng = await AsyncLLM.create(str(tiny_model_dir), in_process=True, **engine)
        try:

            async def one(ids, rid):
                return [o async for o in eng.generate(ids, params, request_id=rid)]

            faulty = asyncio.create_task(one(prompts[0], "faulty"))
            await asyncio.sleep(0)  # sent first
            waiting = asyncio.create_task(one(prompts[1], "waiting"))
            with pytest.raises(RequestFailedError):
                await asyncio.wait_for(faulty, 60)
            outs = await asyncio.wait_for(waiting, 60)
            assert not eng.dead
            return outs[-1].outputs[0].token_ids
        finally:
            await eng.shutdown()

    assert asyncio.run(run()) == expected[0].outputs[0].token_ids


def test_iteration_stats_follow_vllms_definitions(tiny_model_dir, prompts):
    """What `on_step` reports (the server's Prometheus metrics are made of it): each token
    counted once, a prompt's tokens when its first token comes, one TTFT per request, an ITL
    per later step that gave tokens, the phases of each finished request adding up, n and the
    longest completion per prompt once all its completions ended, and an abort as one."""
    reports = []

    async def run():
        eng = await AsyncLLM.create(str(tiny_model_dir), in_process=True, **ENGINE)
        eng.on_step = reports.append
        (stat_logger,) = eng.stat_loggers  # (serving logs vLLM's lines by default)
        stat_logger.interval = float("inf")
        try:
            five = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            pair = SamplingParams(n=2, temperature=0.8, max_tokens=4, ignore_eos=True, seed=1)

            async def drain(stream):
                return [o async for o in stream][-1].outputs[0]

            outs = await asyncio.gather(
                drain(eng.generate(prompts[0], five, request_id="a")),
                drain(eng.generate(prompts[1], pair, request_id="g")),
                drain(
                    eng.generate(prompts[1], pair, request_id="g-1", index=1, prefix_parent="g")
                ),  # fmt: skip
            )
            assert [len(o.token_ids) for o in outs] == [5, 4, 4]
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            async with contextlib.aclosing(eng.generate(prompts[2], long, request_id="left")) as s:
                async for out in s:
                    if len(out.outputs[0].token_ids) >= 2:
                        break
            left = len(out.outputs[0].token_ids)
            await asyncio.sleep(0.2)  # (the abort's report)
            # The log lines count what the metrics count.
            assert stat_logger.prompt_tokens == sum(r.num_prompt_tokens for r in reports) > 0
            assert stat_logger.generation_tokens == sum(r.num_generation_tokens for r in reports)
        finally:
            await eng.shutdown()
        return left

    left = asyncio.run(run())
    finished = {f.finish_reason: f for r in reports for f in r.finished}
    assert sorted(f.finish_reason for r in reports for f in r.finished) == [
        "abort", "length", "length", "length"]  # fmt: skip
    generated = sum(r.num_generation_tokens for r in reports)
    assert generated >= 5 + 4 + 4 + left  # the aborted one may have had more in flight
    assert sum(r.num_prompt_tokens for r in reports) == len(prompts[0]) + 2 * len(
        prompts[1]) + len(prompts[2])  # fmt: skip
    assert len([t for r in reports for t in r.time_to_first_tokens]) == 4
    assert all(f.queued_time > 0 for r in reports for f in r.finished)
    assert all(t >= 0 for r in reports for t in r.inter_token_latencies)
    for f in (f for r in reports for f in r.finished):
        assert f.prefill_time >= 0 and f.decode_time >= 0 and f.queued_time >= 0
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
        assert f.e2e_latency >= f.inference_time
        if f.num_generation_tokens > 1:
            tpot = f.decode_time / (f.num_generation_tokens - 1)
            assert f.mean_time_per_output_token == pytest.approx(tpot)
    assert finished["abort"].max_tokens_param == 200
    # n: once per prompt, for the pair, and 1 for each single request.
    assert sorted(n for r in reports for n in r.n_params) == [1, 1, 2]
    assert sorted(m for r in reports for m in r.max_num_generation_tokens)[1:] == [4, 5]
    host = [r.step.host_seconds for r in reports if r.step and r.step.host_seconds is not None]
    assert host and all(0 < h < 60 for h in host)
