"""Data parallelism (`--data-parallel-size`): two engine cores, each a process on its own CPU
core, behind one AsyncLLM: the same greedy tokens as one engine, both cores serving, metrics
per rank, and a core killed mid-flight failing only its own requests while the other serves."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from jaxllm import SamplingParams
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.errors import EngineDeadError, RequestFailedError
from server.metrics import Metrics

ENGINE = dict(max_model_len=256, num_pages=128, max_num_seqs=16, max_num_batched_tokens=128)
PROMPTS = [[5 + i, 17, 40 + 2 * i, 9] * (i + 1) for i in range(8)]


def test_two_engine_cores_serve_as_one(tiny_model_dir, tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in tiny_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ]  # fmt: skip

    async def run():
        eng = await AsyncLLM.create(str(tiny_model_dir), data_parallel_size=2, **ENGINE)
        try:
            assert len(eng.engine_stats) == 2
            # Each core on its own share of the CPU cores.
            cores = [os.sched_getaffinity(c.process.pid) for c in eng.client.clients]
            assert all(cores) and not cores[0] & cores[1], cores

            async def one(ids, max_tokens=12):
                p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                return [o async for o in eng.generate(ids, p)][-1].outputs[0].token_ids

            got = await asyncio.gather(*(one(p) for p in PROMPTS))
            assert got == expected  # the same tokens, whichever core ran each
            steps = [s.num_steps for s in eng.engine_stats]
            assert all(n > 0 for n in steps), steps  # the load was spread over both

            text = Metrics(eng, "tiny").render().decode()
            for rank in ("0", "1"):
                assert f'vllm:num_requests_running{{engine="{rank}",model_name="tiny"}}' in text
                assert f'vllm:generation_tokens_total{{engine="{rank}",model_name="tiny"}}' in text

            # A core killed with requests in flight: its requests fail, the other's finish,
            # and new requests go to the survivor.
            long = [one(p, max_tokens=220) for p in PROMPTS]
            tasks = [asyncio.ensure_future(t) for t in long]
            for _ in range(20_000):  # until core 1 has requests in flight
                if eng.engine_stats[1].num_running:
                    break
                await asyncio.sleep(0.001)
            victim = eng.client.clients[1].process
            os.kill(victim.pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            done = [r for r in results if not isinstance(r, BaseException)]
            assert failed and done, results
            assert all(isinstance(e, RequestFailedError | EngineDeadError) for e in failed)
            assert all(len(r) == 220 for r in done)
            assert not eng.dead
            assert await asyncio.gather(*(one(p) for p in PROMPTS[:3])) == expected[:3]
        finally:
            await eng.shutdown()

    asyncio.run(run())


def test_the_offline_engine_runs_one_core(tiny_model_dir):
    from jaxllm import LLM

    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(tiny_model_dir, data_parallel_size=2, skip_warmup=True, **ENGINE)


def test_ranks_kv_event_ports_must_not_collide(tiny_model_dir):
    """Each rank publishes on its ports shifted by its rank (vLLM's rule): a replay port one
    above the endpoint collides at data_parallel_size 2, refused before any core starts."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.dp_client import _check_event_endpoints

    def config(replay):
        events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                  "replay_endpoint": replay}  # fmt: skip
        return EngineConfig.create(str(tiny_model_dir), kv_events_config=events)

    with pytest.raises(ValueError, match="kv_events_config"):
        _check_event_endpoints(config("tcp://*:5558"), 2)
    _check_event_endpoints(config("tcp://*:5567"), 2)
