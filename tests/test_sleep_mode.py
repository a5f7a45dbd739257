"""Sleep mode (vLLM's): the weights and the KV cache leave the device memory, and waking serves
the same tokens with nothing compiled; through `LLM` and through the server's `/sleep`,
`/wake_up` and `/is_sleeping`."""

from __future__ import annotations

import time

import httpx
import jax
import pytest

from jaxllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_device_and_waking_serves_the_same_tokens(tiny_model_dir, level):
    llm = LLM(str(tiny_model_dir), max_model_len=128, num_pages=64, max_num_seqs=4,
              max_num_batched_tokens=64)  # fmt: skip
    before = _tokens(llm)
    compiled = llm.runner.num_compilations
    weights = sum(p.nbytes for p in llm.runner.params)
    cache = sum(a.nbytes for a in jax.tree.leaves(llm.runner.device.kv_cache))
    awake = _live_bytes()
    llm.sleep(level)
    assert llm.is_sleeping and awake - _live_bytes() >= weights + cache
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS[0], GREEDY)
    start = time.perf_counter()
    llm.wake_up()
    print(f"level {level}: woke in {time.perf_counter() - start:.3f} s")
    assert not llm.is_sleeping
    assert _tokens(llm) == before
    assert llm.runner.num_compilations == compiled
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    # Only an idle engine sleeps: a queued request keeps it awake.
    from jaxllm.engine.messages import AddRequest

    request = llm.input_processor.request("busy", [5, 6, 7], GREEDY)
    assert isinstance(request, AddRequest)
    llm.loop.handle(request)
    with pytest.raises(ValueError, match="unfinished"):
        llm.sleep(level)
    llm.loop.settle(abort=["busy"])


def _compilations(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("jaxllm:num_compilations"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no jaxllm:num_compilations")


def test_the_servers_sleep_mode(tiny_model_dir):
    """`--enable-sleep-mode`: /sleep frees the device, requests meanwhile get 503 with
    Retry-After, /wake_up serves the same tokens, nothing compiles."""
    from tests.test_server_e2e import _start_server, _stop_server

    proc, url = _start_server(tiny_model_dir, "--enable-sleep-mode")
    try:
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip

        def tokens():
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        before = tokens()
        compiled = _compilations(url)
        for level in (1, 2):
            assert httpx.post(f"{url}/sleep", params={"level": level}).status_code == 200
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "asleep" in r.json()["error"]["message"]
            start = time.perf_counter()
            assert httpx.post(f"{url}/wake_up", timeout=120).status_code == 200
            print(f"server level {level}: woke in {time.perf_counter() - start:.3f} s")
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
            assert tokens() == before
        assert httpx.post(f"{url}/sleep", params={"level": 3}).status_code == 400
        assert _compilations(url) == compiled
    finally:
        log = _stop_server(proc)
    assert "Traceback" not in log, log[-3000:]
