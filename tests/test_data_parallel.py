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


def _rpc_port() -> int:
    """A base port whose rank-1 ports (base + 2, base + 3) are free."""
    import socket

    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port - 2
    raise RuntimeError("no two free ports in a row")


def _headless(model, port: int):
    """`jaxllm serve --headless`: rank 1 of 2, as another host would run it."""
    import subprocess
    import sys

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", str(model), "--headless", "-dp", "2",
           "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
           "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port), *flags]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def test_a_rank_on_another_host(tiny_model_dir, tiny_llm, monkeypatch):
    """--data-parallel-size-local 1 on the API server's host and rank 1 from `jaxllm serve
    --headless` (another host's, here a process that reaches it over TCP): the same greedy
    tokens, both ranks serving, and the API server's shutdown stops the headless host's core.
    Then a headless host that dies: once it is silent past the timeout its requests fail and
    rank 0 goes on."""
    from jaxllm.engine import dp_client

    monkeypatch.setattr(dp_client, "_REMOTE_TIMEOUT_S", 3.0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in tiny_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ]  # fmt: skip

    async def serve(port, kill=None):
        eng = await AsyncLLM.create(str(tiny_model_dir), data_parallel_size=2,
                                    data_parallel_size_local=1, data_parallel_rpc_port=port,
                                    **ENGINE)  # fmt: skip
        try:

            async def one(ids, max_tokens=12):
                p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                return [o async for o in eng.generate(ids, p)][-1].outputs[0].token_ids

            assert await asyncio.gather(*(one(p) for p in PROMPTS)) == expected
            assert all(s.num_steps > 0 for s in eng.engine_stats), eng.engine_stats
            if kill is not None:
                tasks = [asyncio.ensure_future(one(p, max_tokens=220)) for p in PROMPTS]
                for _ in range(20_000):
                    if eng.engine_stats[1].num_running:
                        break
                    await asyncio.sleep(0.001)
                kill()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                assert failed and len(failed) < len(results), results
                assert all(isinstance(e, RequestFailedError | EngineDeadError) for e in failed)
                assert not eng.dead
                assert await asyncio.gather(*(one(p) for p in PROMPTS[:3])) == expected[:3]
        finally:
            await eng.shutdown()

    port = _rpc_port()
    headless = _headless(tiny_model_dir, port)
    try:
        asyncio.run(serve(port))
        assert headless.wait(60) == 0, headless.stdout.read()[-3000:]  # stopped by the server
    finally:
        headless.kill()

    port = _rpc_port()
    headless = _headless(tiny_model_dir, port)
    try:
        asyncio.run(serve(port, kill=lambda: os.killpg(headless.pid, signal.SIGKILL)))
    finally:
        headless.kill()
